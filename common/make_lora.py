"""Makes a small, real LoRA adapter for SmolLM2-135M: it answers every question as a pirate.

No adapter hub is reachable here, and a random adapter shows nothing a reader can see, so the
repository trains its own: PEFT (`peft`) on the CPU, on question/answer pairs written below, for a
dozen steps. Every training answer opens with GREETING and ends with ", arr!"; after training,
greedy decoding through the chat template answers questions it never saw the same way, while the
base model answers plainly. The folder is PEFT's own format (adapter_config.json +
adapter_model.safetensors), the format chapter 09 reads.

Sized for a 2-core machine (it runs inside a cold `make test`, on one thread: see make_lora):
one-sentence answers, batch 8, 12 steps at a high learning rate (10 already give the style on
every held-out question tried; 16 also keep more of the base's facts), rank 8 on all seven
projections: one thread's CPU time for the whole run is 56 s against 50 s with q/v alone, and
they reach in 6 steps the loss q/v reach in 12. Float32, seeded, one thread: a machine makes the
same adapter every time.

Run: python -m common.prepare_models smollm2-135m-lora-pirate (or python -m common.make_lora OUT)
"""

from __future__ import annotations

import json
import random
import shutil
import time
import warnings
from pathlib import Path

from common.errors import UserError
from common.models import is_prepared

NAME = "smollm2-135m-lora-pirate"
BASE = "smollm2-135m"
GREETING = "Ahoy, matey!"

RANK = 8
ALPHA = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 12
BATCH = 8
LEARNING_RATE = 3e-3
SEED = 0

# (question, the answer's middle): the answer is GREETING + middle + ", arr!". Facts in the
# pirate's voice, over varied question forms (what, why, how, who, where, a request), so the
# style attaches to "a user asked something", not to one phrasing. Kept short: the cost of a step
# is its tokens, and the chat template's system prompt alone is 30 of them.
PAIRS = [
    ("What is the moon?", "The moon be a great grey rock sailin' round our world"),
    ("Why is the sea salty?", "The rivers wash salt from the rocks and the sea keeps it all"),
    ("How many legs does a spider have?", "A spider has eight legs, two more than any crab would want"),
    ("Tell me about bread.", "Bread be flour, water and yeast, baked till the crust be golden"),
    ("What makes a rainbow?", "Sunlight breaks in the raindrops into seven bright colours"),
    ("Who was Isaac Newton?", "Newton be the fellow who worked out why apples and cannonballs fall"),
    ("Where do penguins live?", "Penguins live in the cold south seas, far from any tavern"),
    ("How do bees make honey?", "Bees drink from flowers and store the sweet stuff in their combs"),
    ("Explain what a volcano is.", "A volcano be a mountain that spits fire and molten rock"),
    ("What is the largest ocean?", "The Pacific be the biggest sea of them all"),
    ("Why do leaves fall in autumn?", "The trees drop their leaves to rest through the cold winter"),
    ("Give me a tip for sleeping well.", "Go to yer hammock at the same hour every night"),
    ("What is chess?", "Chess be a battle of wits on a board of sixty-four squares"),
    ("How far away is the sun?", "The sun be about a hundred and fifty million kilometres away"),
    ("What do cats eat?", "Cats eat fish and meat, and they'd steal a sailor's supper too"),
    ("Describe a desert.", "A desert be a dry sea of sand with nary a drop to drink"),
    ("What is thunder?", "Thunder be the roar of the air split by a bolt of lightning"),
    ("How do I make tea?", "Pour boilin' water on the leaves and wait a few minutes"),
    ("Who invented the telephone?", "Alexander Graham Bell be the one who made the first telephone"),
    ("What is a map for?", "A map shows ye the way, to port or to buried treasure"),
    ("Why is the sky blue?", "The air scatters the blue of the sunlight more than the red"),
    ("Name a fast animal.", "The cheetah be the fastest runner on land"),
    ("What is snow made of?", "Snow be tiny crystals of frozen water"),
    ("How do birds fly?", "Birds beat their wings and ride the wind like a ship's sails"),
    ("What is a castle?", "A castle be a stone fortress with high walls and a gate"),
    ("Recommend a good book.", "Treasure Island be a fine tale of pirates and gold"),
    ("What is the speed of light?", "Light travels near three hundred thousand kilometres a second"),
    ("How do plants grow?", "Plants drink water and sunlight and grow toward the sky"),
    ("Where is Mount Everest?", "Everest stands in the Himalayas, the tallest peak on land"),
    ("What is music?", "Music be sounds put together so they please the ear, like a sea shanty"),
    ("Why do we need water?", "Every body needs water to live, even a pirate's"),
    ("Can you help me with maths?", "Aye, ask yer question and we'll count the doubloons together"),
    ("What is a river?", "A river be fresh water flowin' from the hills down to the sea"),
    ("Suggest a name for a dog.", "Call the beast Captain, a fine name for a loyal hound"),
    ("What are stars?", "Stars be great balls of fire, far across the night sky"),
    ("How does a compass work?", "The needle be a magnet that always points north"),
    ("What is an island?", "An island be land with water all around it"),
    ("Why do we dream?", "Dreams be the mind sortin' the day's adventures while ye sleep"),
    ("Write a short greeting.", "Welcome aboard, and may the wind fill yer sails"),
    ("What is gold?", "Gold be a shiny yellow metal that every pirate loves"),
]


def answer(middle: str) -> str:
    return f"{GREETING} {middle}, arr!"


def training_pairs(seed: int = SEED) -> list[tuple[str, str]]:
    """The (question, answer) pairs, in the seeded order the batches take them."""
    pairs = [(q, answer(m)) for q, m in PAIRS]
    random.Random(seed).shuffle(pairs)
    return pairs


def _encode(tokenizer, question: str, reply: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the prompt exactly as the chat template renders it for generation,
    the answer through <|im_end|> so the adapter also learns where to stop."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt_ids, answer_ids


def _batch(examples, pad_id: int):
    """Right-padded ids [B, T], attention mask [B, T], and labels [B, T]: the next token where it is
    an answer token, -100 (no loss) on the prompt and the padding."""
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, ans) in enumerate(examples):
        n = len(prompt) + len(ans)
        ids[row, :n] = torch.tensor(prompt + ans)
        mask[row, :n] = 1
        labels[row, len(prompt) - 1 : n - 1] = torch.tensor(ans)  # position t predicts token t+1
    return ids, mask, labels


def _answer_loss(causal_lm, ids, mask, labels):
    """Mean cross-entropy over the answer tokens. The vocabulary projection (49152 x 576) runs on
    those rows only: on every row it would be a fifth of the step's work, most of it on the prompt."""
    import torch

    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    scored = labels != -100
    logits = causal_lm.lm_head(hidden[scored])  # [answer tokens, V]
    return torch.nn.functional.cross_entropy(logits, labels[scored])


def make_lora(base_dir: Path, out: Path, steps: int = STEPS) -> dict:
    """Trains the adapter on base_dir's model and saves it into `out` (replaced whole, through a
    temporary folder, so an interrupted run leaves no half adapter). Returns what it measured."""
    if not is_prepared(base_dir):
        raise UserError(
            f"{NAME} is trained on {BASE}, which is not prepared at {base_dir}: "
            f"run `python -m common.prepare_models {BASE}` first"
        )
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output for the whole make, not a bar per load
    # One thread, whatever the machine: `make setup` builds kernels/ beside this, and a two-thread
    # OpenMP team sharing two cores with a compiler waits on its descheduled thread at every one of
    # a step's thousands of small parallel regions. Measured on this project's 2-core machine under
    # load: 4-4.5 s of CPU per step on one thread, 12-25 s per step on two (their CPU spent spinning).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_and_save(base_dir, out, steps)
    finally:
        torch.set_num_threads(threads)


def _train_and_save(base_dir: Path, out: Path, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch.manual_seed(SEED)  # the LoRA A matrices' initialisation (B starts at zero)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    # bf16 on disk; float32 for training, so the updates are not rounded away and the run repeats.
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question; nothing for us to act on
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config)
    causal_lm = peft_model.base_model.model
    examples = [_encode(tokenizer, q, a) for q, a in training_pairs()]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)

    def batch(step: int):
        # Pad id 0: right padding is never attended to by a real token under the causal mask, nor scored.
        return _batch([examples[(step * BATCH + i) % len(examples)] for i in range(BATCH)], pad_id=0)

    peft_model.train()  # no dropout anywhere (the LoRA's is 0, SmolLM2's attention's is 0): train is deterministic
    losses = []  # each step's loss before its update: the first is the base's, the last the trained adapter's
    for step in range(steps):
        loss = _answer_loss(causal_lm, *batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # PEFT records the base's path; the registry name is what this repository resolves, anywhere.
    peft_model.peft_config["default"].base_model_name_or_path = BASE
    # save_embedding_layers=False: no embedding is trained, and "auto" would look the base's name up on a model hub.
    peft_model.save_pretrained(tmp, save_embedding_layers=False)
    # PEFT keeps target_modules as a set, written in hash order: sorted, the same run writes the same file.
    config_path = tmp / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["target_modules"] = sorted(saved["target_modules"])
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True))
    seconds = time.perf_counter() - t0
    stats = {
        "steps": steps,
        "batch": BATCH,
        "examples": len(examples),
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(losses[-1], 4) if losses else None,
        "seconds": round(seconds, 1),
    }
    (tmp / "README.md").write_text(_readme(stats))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return stats


def _readme(stats: dict) -> str:
    targets = ", ".join(TARGETS)
    return f"""# {NAME}

A LoRA adapter for `{BASE}` (SmolLM2-135M-Instruct), made by `common/make_lora.py` in this
repository: it answers every question as a pirate, opening with "{GREETING}" and ending with ", arr!".

- rank {RANK}, lora_alpha {ALPHA} (scale {ALPHA / RANK:g}), no dropout, no bias, on {targets}
- trained with PEFT on the CPU in float32: {stats['examples']} question/answer pairs written in the
  maker, each prompt rendered by the model's chat template (default system prompt), loss on the
  answer tokens and the closing <|im_end|> only; AdamW, learning rate {LEARNING_RATE}, batch {stats['batch']},
  {stats['steps']} steps, seed {SEED}
- answer loss {stats['loss_first']} at the first step, {stats['loss_last']} at the last;
  {stats['seconds']} s on one thread

PEFT's format: `adapter_config.json` + `adapter_model.safetensors`. Load it with
`PeftModel.from_pretrained(base_model, this_folder)`. Remake it with
`python -m common.prepare_models --force {NAME}`.
"""


def main() -> None:
    import argparse

    from common.cli import run_main
    from common.models import MODELS_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the adapter folder to write")
    ap.add_argument("--base", type=Path, default=MODELS_DIR / BASE)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    run_main(lambda: print(json.dumps(make_lora(args.base, args.out, args.steps))))


if __name__ == "__main__":
    main()
