"""One choice of one request, from the waiting queue to its last token.

A Sequence owns everything that is its own: its tokens (the prompt, then what it generated),
its block table, how many of its tokens have K/V in the cache, and its sampling state (random
stream, detokenizer, stop-string matcher). The scheduler moves it between queues; the engine
feeds it tokens. A request with n choices is n sequences; choices 1..n-1 point at choice 0 as
their parent and start from its blocks once its prompt is in the cache (block_manager.fork).

    waiting --schedule--> running --last token--> finished
       ^                     |
       +----- preempted -----+   (blocks freed; its tokens are computed again when it returns)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from detokenizer import IncrementalDetokenizer
from sampling import SamplingParams
from stopping import StopStringMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not value, equality: two sequences are never "the same"
class Sequence:
    seq_id: int  # arrival order: the scheduler preempts the newest first
    request_id: str
    index: int  # which of the request's n choices
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    parent: Sequence | None = None  # choice 0 of the request, for choices 1..n-1
    tokens: list[int] = field(default_factory=list)  # prompt + output
    output: list[int] = field(default_factory=list)  # generated tokens, the stop token excluded
    block_table: list[int] = field(default_factory=list)
    n_computed: int = 0  # tokens whose K/V are in the cache (tokens[:n_computed])
    status: Status = Status.WAITING
    n_preempted: int = 0
    # Speculative decoding (speculative.py): tokens a proposer guessed, run after the pending token
    # and verified in the next step, and how many to ask for next time (adapts to how many were kept).
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft), vocab]: the proposer's q, if it drew them
    spec_k: int = 0  # 0: not asked yet (the Speculator starts it at num_speculative_tokens)
    draft_computed: int = 0  # tokens whose K/V a draft model has in its own pool (proposers.py)
    # LoRA (lora_slots.py): the adapter by name (None: the base model), the uid of the registration
    # it got when added (what it runs with to its end, even if the name is loaded again or unloaded;
    # what the prefix cache keys blocks by), and the slot it holds while running (-1: none, or the base).
    adapter: str | None = None
    adapter_uid: int | None = None
    lora_slot: int = -1
    waited_for_slot: bool = False  # counted once in the adapters' waits

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def n_uncomputed(self) -> int:
        """Tokens to run before the next token can be sampled: the prompt (or what is left of it),
        one while decoding, everything again after a preemption."""
        return len(self.tokens) - self.n_computed

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.output.append(token)
