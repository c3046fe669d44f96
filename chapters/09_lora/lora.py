"""LoRA adapters: a PEFT directory read and checked, the slot table the model reads them from, and
the delta each projection adds for the rows of a step.

A LoRA fine-tune leaves the base weight W [n_out, n_in] as it is and learns two thin matrices,
A [r, n_in] and B [n_out, r] (r: 8 or 16 where W is 576 x 576), so that the tuned layer is

    y = W x + scale * B (A x)          scale = alpha / r   (rsLoRA: alpha / sqrt(r))

Computed in that order, the delta costs r * (n_in + n_out) multiply-adds a row: a few percent of
W x. One base model can therefore serve many adapters at once: every row of a step goes through
the same W x (one matmul for the whole batch), and only the thin part differs per row (Punica,
S-LoRA). The rows of a step are cut into segments of one adapter slot each; per projection,

    v = shrink(x)     v[row] = A[slot] x[row]            [rows, r_max], float32
    y = expand(y, v)  y[row] += scale[slot] * B[slot] v  rows of slot -1 (the base) untouched

kernels/ has both as one call over all segments (ops.lora_shrink, ops.lora_expand_; the maths is
kernels/reference.py's `lora`), and `torch_delta_` below is the same maths by slot for --kernels
off. The slot table keeps every resident adapter's A and B stacked, so a step needs no copy:

    a    [layers, slots, r_max, n_in]    A of each slot, rows past its rank zero
    b_t  [layers, slots, r_max, n_out]   B transposed: a rank row of B.T is contiguous in n_out
    ranks int32 [slots] per projection   0: the adapter leaves that projection alone
    scale float32 [slots]

Which adapter sits in which slot, and when one is swapped out, is lora_slots.py's business.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import LlamaConfig
from common.errors import UserError

# PEFT's names of the seven linear layers of a Llama decoder layer, in the order the model's fused
# matmuls lay their outputs: q, k, v in wqkv; gate, up in w_gate_up (model.py).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's four matmuls and the projections whose outputs they hold, side by side.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MODULE = {p: ("self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for p in PROJECTIONS}
# PEFT's key of a LoRA weight; a save of the whole state dict keeps the adapter's name (lora_A.default.weight)
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.([^.]+))?\.weight")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # read into the model's dtype

# PEFT features this engine does not compute: refused by name, never served as plain LoRA. (Served:
# rank_pattern, alpha_pattern, layers_to_transform, a target_modules pattern; `bias` trains biases the
# base's linears lack, so a trained one shows as a tensor, refused there; fan_in_fan_out is GPT-2's
# Conv1D layout, which PEFT turns off for a Llama's nn.Linear.)
# (config key, whether a value turns it on, what to say)
_UNSUPPORTED = (
    ("use_dora", lambda v: bool(v), "DoRA (use_dora)"),
    ("lora_bias", lambda v: bool(v), "trained LoRA biases (lora_bias)"),
    ("modules_to_save", lambda v: bool(v), "fully trained modules (modules_to_save)"),
    ("exclude_modules", lambda v: bool(v), "excluded modules (exclude_modules)"),
    ("layer_replication", lambda v: bool(v), "replicated layers (layer_replication)"),
    ("use_qalora", lambda v: bool(v), "QA-LoRA (use_qalora)"),
    ("trainable_token_indices", lambda v: bool(v), "trained token embeddings (trainable_token_indices)"),
    # PEFT's variants whose forward is not W x + scale * B (A x) on every token: aLoRA switches on at
    # its invocation tokens, BD-LoRA's A and B are block-diagonal, the others change the maths.
    ("alora_invocation_tokens", lambda v: bool(v), "Activated LoRA (alora_invocation_tokens)"),
    ("use_bdlora", lambda v: bool(v), "block-diagonal LoRA (use_bdlora)"),
    ("target_parameters", lambda v: bool(v), "LoRA on parameters (target_parameters)"),
    ("arrow_config", lambda v: bool(v), "Arrow routing (arrow_config)"),
    ("kasa_config", lambda v: bool(v), "KaSA (kasa_config)"),
    ("velora_config", lambda v: bool(v), "VeLoRA (velora_config)"),
    ("monteclora_config", lambda v: bool(v), "MonteCLoRA (monteclora_config)"),
    # The initialisations PEFT runs again when it loads such an adapter, on the base weights too: it
    # serves W - (the initial B A) + B A, not W + B A. (True, False, gaussian, eva, orthogonal: plain A, B.)
    (
        "init_lora_weights",
        lambda v: isinstance(v, str) and v not in ("gaussian", "eva", "orthogonal"),
        "an initialisation that changes the base weights or the LoRA forward when PEFT loads it "
        "(init_lora_weights; PiSSA, OLoRA, CorDA and LoftQ convert to a plain LoRA with "
        "save_pretrained(path_initial_model_for_weight_conversion=...))",
    ),
)


def projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(n_out, n_in) of each projection of a decoder layer with `config`'s sizes."""
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


@dataclass
class Adapter:
    """One PEFT LoRA adapter as read from disk, kept on the host: what a slot is filled from."""

    path: Path
    rank: int  # the slot's rank: the largest of its modules' (a smaller one's A and B sit zero-padded)
    scale: float
    # (layer, projection) -> (A [r, n_in], B [n_out, r]), in the model's dtype; B carries a module's
    # own scale where rank_pattern / alpha_pattern make it differ from `scale` (B * its / scale)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""  # of the bytes read: a later read of the folder must find the same adapter

    @property
    def targets(self) -> set[str]:
        return {p for _, p in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(path: str | Path, config: LlamaConfig, max_rank: int, dtype: torch.dtype) -> Adapter:
    """A PEFT LoRA directory checked against the base model's `config` and the rank limit.
    Raises UserError, one line naming the file and what is wrong, for anything it cannot serve
    exactly: a result computed without part of the adapter would be a wrong answer, not a worse one."""
    path = adapter_directory(path)
    raw_config = _read_bytes(path, CONFIG)
    settings = _parse_config(path, raw_config)
    _check_config(path, settings, max_rank)
    modules = _modules(path, settings, config)  # (layer, projection) -> (its rank, its scale)
    scale = _slot_scale(modules)
    raw_weights = _read_bytes(path, WEIGHTS)
    weights = _pair_up(path, _parse_tensors(path, raw_weights), config, modules, scale, dtype)
    _check_delta(path, weights, scale)
    digest = hashlib.sha256(raw_config + b"\0" + raw_weights).hexdigest()
    return Adapter(path, max(r for r, _ in modules.values()), scale, weights, digest)


def adapter_directory(path: str | Path) -> Path:
    """The adapter's folder, `~` expanded; UserError where it is not one."""
    try:
        path = Path(path).expanduser()
        if path.is_dir():
            return path
    except (RuntimeError, OSError) as e:  # ~user with no home; a name too long for the file system
        raise UserError(f"LoRA adapter {str(path)[:200]}: not a readable directory ({e})") from None
    raise UserError(f"LoRA adapter {path}: no such directory")


def config_rank(path: str | Path) -> int:
    """The largest rank a PEFT directory's adapter_config.json declares (r, rank_pattern; UserError
    for a missing or bad config), for sizing a slot table before reading the adapter."""
    path = adapter_directory(path)
    return _check_config(path, _parse_config(path, _read_bytes(path, CONFIG)), max_rank=sys.maxsize)


def _shown(value) -> str:
    """A config value in a message: its repr, cut where it would flood the line."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _read_bytes(path: Path, name: str) -> bytes:
    file = path / name
    if not file.is_file():
        if name == CONFIG:
            raise UserError(f"LoRA adapter {path}: no {CONFIG} (a PEFT adapter directory holds {CONFIG} and {WEIGHTS})")
        pickled = (path / "adapter_model.bin").exists()
        hint = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" if pickled else ""
        raise UserError(f"LoRA adapter {path}: no {WEIGHTS}{hint}")
    try:
        return file.read_bytes()
    except OSError as e:
        raise UserError(f"LoRA adapter {file}: cannot be read ({e.strerror or e})") from None


def _parse_config(path: Path, raw: bytes) -> dict:
    file = path / CONFIG
    try:
        settings = json.loads(raw)
    except ValueError as e:  # bad JSON or UTF-8, or a number of more digits than Python converts
        raise UserError(f"LoRA adapter {file}: not valid JSON ({str(e)[:200]})") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise UserError(f"LoRA adapter {file}: not a PEFT config (JSON nested too deeply to read)") from None
    if not isinstance(settings, dict):
        raise UserError(f"LoRA adapter {file}: a JSON object expected, got {type(settings).__name__}")
    return settings


def _check_config(path: Path, settings: dict, max_rank: int) -> int:
    """-> the largest rank it declares; UserError for what cannot be served."""
    where = f"LoRA adapter {path / CONFIG}"
    kind = settings.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise UserError(f"{where}: peft_type {_shown(kind)} is not LoRA")
    for key, is_on, what in _UNSUPPORTED:
        if key in settings and is_on(settings[key]):
            raise UserError(f"{where}: {what} is not supported ({key} = {_shown(settings[key])}); merge or retrain without it")
    ranks = [_positive_int(where, "r", settings.get("r", 8))]  # PEFT's defaults: r 8, lora_alpha 8
    _finite(where, "lora_alpha", settings.get("lora_alpha", 8))
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = settings.get(key) or {}
        if not isinstance(pattern, dict):
            raise UserError(f"{where}: {key} must map module names to values, got {_shown(pattern)}")
        for name, value in pattern.items():
            try:
                re.compile(rf"(.*\.)?({name})$")  # as _pattern_value uses it
            except (re.error, TypeError) as e:
                raise UserError(f"{where}: {key} key {_shown(name)} is not a regular expression ({e})") from None
            if key == "rank_pattern":
                ranks.append(_positive_int(where, f"rank_pattern[{name!r}]", value))
            else:
                _finite(where, f"alpha_pattern[{name!r}]", value)
    if max(ranks) > max_rank:
        raise UserError(f"{where}: rank {max(ranks)} is over --max-lora-rank {max_rank}; raise the limit to serve it")
    return max(ranks)


def _positive_int(where: str, name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {name} must be a positive integer, got {_shown(value)}")
    return value


def _finite(where: str, name: str, value) -> None:
    # Python's JSON reader takes NaN and Infinity; a scale that is not a finite float32 makes every
    # logit of the adapter's rows NaN.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise UserError(f"{where}: {name} must be a finite number, got {_shown(value)}")


def _modules(path: Path, settings: dict, config: LlamaConfig) -> dict[tuple[int, str], tuple[int, float]]:
    """The modules the config adapts, by PEFT's rules of matching (peft.tuners.tuners_utils'
    check_target_module_exists, on the names a LlamaForCausalLM gives them), each with its rank and
    scale: -> (layer, projection) -> (r, scale)."""
    where = f"LoRA adapter {path / CONFIG}"
    names = {(i, p): f"model.layers.{i}.{_MODULE[p]}.{p}" for i in range(config.num_hidden_layers) for p in PROJECTIONS}
    targets = settings.get("target_modules")
    if targets is None:
        targets = ["q_proj", "v_proj"]  # PEFT's default for a Llama
    if targets == "all-linear":
        targets = list(PROJECTIONS)  # PEFT's shorthand: every linear layer but the LM head
    if isinstance(targets, str):  # a regular expression over the whole name (layers_to_transform not applied)
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise UserError(f"{where}: target_modules {_shown(targets)} is not a regular expression ({e})") from None
        chosen = {k for k, name in names.items() if pattern.fullmatch(name)}
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        hits = {t: {k for k, name in names.items() if name == t or name.endswith("." + t)} for t in targets}
        unknown = [t for t, found in hits.items() if not found]
        if unknown:
            raise UserError(f"{where}: unknown target module {unknown[0]!r}; LoRA is served on {', '.join(PROJECTIONS)}")
        # a target that is a module's whole name adapts it whatever layers_to_transform says (PEFT's rule)
        suffixed = any(names[k] != t for t, found in hits.items() for k in found)
        keeps = _layer_filter(where, settings, config) if suffixed else None
        chosen = {k for t, found in hits.items() for k in found if names[k] == t or keeps(names[k])}
    else:
        raise UserError(f"{where}: target_modules must list the adapted modules, got {_shown(targets)}")
    if not chosen:
        raise UserError(f"{where}: target_modules {_shown(targets)} adapt none of the decoder layers' projections")
    r, alpha, rslora = settings.get("r", 8), settings.get("lora_alpha", 8), bool(settings.get("use_rslora"))
    modules = {}
    for k in sorted(chosen):
        r_k = _pattern_value(settings.get("rank_pattern") or {}, names[k], r)
        alpha_k = _pattern_value(settings.get("alpha_pattern") or {}, names[k], alpha)
        try:
            scale = alpha_k / math.sqrt(r_k) if rslora else alpha_k / r_k
        except OverflowError:  # an integer alpha past float64
            scale = math.inf
        if not abs(scale) <= torch.finfo(torch.float32).max:
            raise UserError(f"{where}: lora_alpha {_shown(alpha_k)} overflows float32 as a scale")
        modules[k] = (r_k, float(scale))
    return modules


def _layer_filter(where: str, settings: dict, config: LlamaConfig):
    """layers_to_transform (with layers_pattern) checked once: -> whether it keeps a module of that
    name, as PEFT decides it."""
    wanted = settings.get("layers_to_transform")
    if wanted is None or wanted == []:
        return lambda name: True
    wanted = [wanted] if isinstance(wanted, int) and not isinstance(wanted, bool) else wanted
    if not isinstance(wanted, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in wanted):
        raise UserError(f"{where}: layers_to_transform must be a layer index or a list of them, got {_shown(wanted)}")
    outside = [i for i in wanted if not 0 <= i < config.num_hidden_layers]
    if outside:
        raise UserError(
            f"{where}: layers_to_transform names layer {outside[0]}; the base model has {config.num_hidden_layers} layers"
        )
    patterns = settings.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise UserError(f"{where}: layers_pattern must be a name or a list of names, got {_shown(patterns)}")
    indexes = [re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")] if not patterns else []  # the first numbered part
    for p in patterns:
        try:
            indexes.append(re.compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\."))
        except re.error as e:
            raise UserError(f"{where}: layers_pattern {_shown(p)} is not a regular expression ({e})") from None

    def keeps(name: str) -> bool:
        m = next(filter(None, (index.match(name) for index in indexes)), None)
        return m is not None and int(m["idx"]) in wanted

    return keeps


def _pattern_value(pattern: dict, name: str, default):
    """rank_pattern's or alpha_pattern's value for module `name`: the first key that matches the
    end of the name (peft.utils.other.get_pattern_key), else the default."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _slot_scale(modules: dict) -> float:
    """One scale for the slot: the one most modules use (every module's, without rank_pattern and
    alpha_pattern); a module with another has B scaled by its own over this one."""
    scales = [s for _, s in modules.values()]
    nonzero = [s for s in scales if s != 0.0] or scales
    return max(nonzero, key=nonzero.count)


def _parse_tensors(path: Path, raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(raw)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"LoRA adapter {path / WEIGHTS}: the safetensors library cannot read it ({first})") from None


def _pair_up(path, tensors: dict, config: LlamaConfig, modules: dict, scale: float, dtype) -> dict:
    """PEFT's tensors by (layer, projection), checked: every module the config adapts has its A
    and B and no other does, of the base model's shapes and the module's rank, finite."""
    file = path / WEIGHTS
    shapes = projection_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    infixes = set()  # PEFT's adapter name inside a key (lora_A.default.weight), where a save kept it
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None and key.startswith("base_model.model.layers."):
            raise UserError(
                f"LoRA adapter {file}: tensor {key!r} comes from an adapter saved on a bare LlamaModel; "
                "this engine reads one saved on LlamaForCausalLM (base_model.model.model.layers...)"
            )
        if m is None and key.endswith(".bias"):
            raise UserError(f"LoRA adapter {file}: tensor {key!r} is a trained bias, which is not supported; merge or retrain without it")
        if m is None:
            raise UserError(f"LoRA adapter {file}: tensor {key!r} is not a LoRA A or B of a decoder layer's projection")
        layer, module, proj, which = int(m[1]), m[2], m[3], m[4]
        infixes.add(m[5])
        if len(infixes) > 1:
            raise UserError(f"LoRA adapter {file}: its tensors belong to more than one adapter ({sorted(map(str, infixes))})")
        if proj not in PROJECTIONS or _MODULE[proj] != module:
            raise UserError(f"LoRA adapter {file}: unknown target module {module}.{proj} in {key!r}")
        if layer >= config.num_hidden_layers:
            raise UserError(
                f"LoRA adapter {file}: {key!r} adapts layer {layer}; "
                f"the base model has {config.num_hidden_layers} layers"
            )
        if (layer, proj) not in modules:
            raise UserError(
                f"LoRA adapter {file}: {key!r} adapts layer {layer}'s {proj}, which the config's "
                "target_modules (and layers_to_transform) do not name"
            )
        rank, own_scale = modules[layer, proj]
        n_out, n_in = shapes[proj]
        want = (rank, n_in) if which == "A" else (n_out, rank)
        if tuple(t.shape) != want:
            raise UserError(
                f"LoRA adapter {file}: {key} is {list(t.shape)}, the base model needs {list(want)} "
                f"(rank {rank} from {CONFIG}; {proj} is {n_out} x {n_in}): an adapter for another model, or another r?"
            )
        if t.dtype not in WEIGHT_DTYPES:
            raise UserError(
                f"LoRA adapter {file}: {key} is {str(t.dtype).removeprefix('torch.')}; "
                "LoRA weights are read as float32, float16, bfloat16 or float64"
            )
        if which == "B" and own_scale != scale:
            t = t.double() * (own_scale / scale)
        t = t.to(dtype)  # finite as stored is not enough: float32 values can overflow bfloat16
        if not torch.isfinite(t).all():
            raise UserError(
                f"LoRA adapter {file}: {key} is not finite in {str(dtype).removeprefix('torch.')}, the model's dtype"
            )
        found.setdefault((layer, proj), {})[which] = t
    for layer, proj in sorted(modules):
        pair = found.get((layer, proj), {})
        if set(pair) != {"A", "B"}:
            which = "A" if "A" not in pair else "B"
            missing = f"base_model.model.model.layers.{layer}.{_MODULE[proj]}.{proj}.lora_{which}.weight"
            raise UserError(f"LoRA adapter {file}: {missing} is missing (the config's target_modules name it)")
    return {k: (v["A"].contiguous(), v["B"].contiguous()) for k, v in found.items()}


def _check_delta(path: Path, weights: dict, scale: float) -> None:
    """UserError where scale * B A could overflow float32, the kernels' accumulator: every entry
    of it is at most |scale| (|B| |A|)[i, j], the bound computed here (in float32: a sum of
    non-negative terms that overflows is over the limit anyway). Finite weights can still multiply
    into inf, and an adapter served that way gives NaN logits."""
    limit = torch.finfo(torch.float32).max
    for (layer, proj), (a, b) in sorted(weights.items()):
        bound = abs(scale) * float((b.float().abs() @ a.float().abs()).max())
        if not bound < limit:
            raise UserError(
                f"LoRA adapter {path / WEIGHTS}: layer {layer}'s {proj} delta (scale * B A) reaches {bound:.3g}, "
                "past float32's range"
            )


# --- the model's side: the resident slots, and a step's delta --------------------------------------


@dataclass
class StepLora:
    """A step's rows by adapter slot, built once per step (batch.build_step) for every layer."""

    seg_starts: torch.Tensor  # int32 [n_seg + 1] on the device: row boundaries, 0 .. rows
    seg_slots: torch.Tensor  # int32 [n_seg]: each segment's slot, -1 for the base model
    by_slot: list[tuple[int, torch.Tensor]]  # (slot, its rows as int64 indices): the torch path's groups
    slots: frozenset[int]  # slots with rows in this step
    adapted: dict[str, bool] = field(default_factory=dict)  # projection -> whether a slot of the step adapts it
    library_form: object = None  # the same as the library takes it (ops.KernelOps), made once


def step_lora(row_slots: list[int], device) -> StepLora | None:
    """row_slots: each row's slot, -1 for the base. -> the step's table, or None when every row
    is the base model's (the forward pass then is the base model's, bit for bit)."""
    if all(s < 0 for s in row_slots):
        return None
    starts, slots = [0], []
    for i, s in enumerate(row_slots):
        if not slots or s != slots[-1]:
            if slots:
                starts.append(i)
            slots.append(s)
    starts.append(len(row_slots))
    rows = torch.tensor(row_slots)
    used = sorted({s for s in row_slots if s >= 0})
    by_slot = [(s, torch.nonzero(rows == s).flatten().to(device)) for s in used]
    as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return StepLora(as_int32(starts), as_int32(slots), by_slot, frozenset(used))


class LoraWeights:
    """The resident adapters of one model (one rank's shard of it under tensor parallelism): per
    projection the stacked a and b_t of every layer and slot, the slots' ranks and scales.
    Allocated on the first load: an engine that never serves an adapter holds nothing."""

    def __init__(self, config: LlamaConfig, n_slots: int, max_rank: int, dtype: torch.dtype, device):
        self.config, self.n_slots, self.max_rank = config, n_slots, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.shapes = projection_shapes(config)  # this shard's (n_out, n_in)
        self.a: dict[str, torch.Tensor] = {}  # projection -> [layers, slots, r_max, n_in]
        self.b_t: dict[str, torch.Tensor] = {}  # projection -> [layers, slots, r_max, n_out]
        self.ranks = {p: torch.zeros(n_slots, dtype=torch.int32, device=self.device) for p in PROJECTIONS}
        self.rank_of = {p: [0] * n_slots for p in PROJECTIONS}  # the same on the host, for Python's decisions
        self.scale = torch.zeros(n_slots, dtype=torch.float32, device=self.device)
        self.scale_of = [0.0] * n_slots
        self.library_form: list | None = None  # per layer, the tables as the library takes them (ops.KernelOps)

    def _allocate(self) -> None:
        n_layers, shape = self.config.num_hidden_layers, (self.n_slots, self.max_rank)
        for p, (n_out, n_in) in self.shapes.items():
            self.a[p] = torch.zeros(n_layers, *shape, n_in, dtype=self.dtype, device=self.device)
            self.b_t[p] = torch.zeros(n_layers, *shape, n_out, dtype=self.dtype, device=self.device)
        # each layer's [slots, r_max, n] views, made once: a decode step reads 7 per layer
        self.per_layer = [{p: (self.a[p][i], self.b_t[p][i]) for p in PROJECTIONS} for i in range(n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b_t.values()))

    @staticmethod
    def table_bytes(config: LlamaConfig, n_slots: int, max_rank: int, dtype: torch.dtype) -> int:
        """What the slot table takes once allocated: A and B of every projection, layer and slot."""
        per_rank = sum(n_in + n_out for n_out, n_in in projection_shapes(config).values())
        return config.num_hidden_layers * n_slots * max_rank * per_rank * dtype.itemsize

    # Inference mode: the tables are inference tensors wherever the first load happens (in a step, or
    # from a server's request between steps), so every write to them must be in inference mode too.
    @torch.inference_mode()
    def load(self, slot: int, adapter: Adapter) -> None:
        """Copies `adapter` (already cut to this shard, see sharding.shard_adapter) into `slot`."""
        if not self.a:
            self._allocate()
        self.free(slot)
        for (layer, p), (a, b) in adapter.weights.items():  # a module of a smaller rank: zero rows after
            self.a[p][layer, slot, : a.shape[0]] = a.to(self.device)
            self.b_t[p][layer, slot, : a.shape[0]] = b.T.to(self.device)
        for p in adapter.targets:  # a layer the adapter leaves alone keeps zeros: a delta of exactly 0
            self.ranks[p][slot] = adapter.rank
            self.rank_of[p][slot] = adapter.rank
        self.scale[slot] = adapter.scale
        self.scale_of[slot] = adapter.scale

    @torch.inference_mode()
    def free(self, slot: int) -> None:
        """The slot adds nothing any more (rank 0 everywhere); its rows are zeroed so no stale
        weights outlive the adapter."""
        for p in PROJECTIONS:
            if self.rank_of[p][slot]:
                self.a[p][:, slot].zero_()
                self.b_t[p][:, slot].zero_()
            self.ranks[p][slot] = 0
            self.rank_of[p][slot] = 0
        self.scale[slot] = 0.0
        self.scale_of[slot] = 0.0

    def add_(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str, step: StepLora, ops) -> None:
        """y [rows, n_out of the group's projections side by side] += each row's delta, in place,
        for the projections of `group` (GROUPS): x [rows, n_in] is the matmul's input."""
        col, tables = 0, self.per_layer[layer]
        for p in GROUPS[group]:
            n_out = self.shapes[p][0]
            if self.adapts(p, step):
                part = y[:, col : col + n_out]  # a view: the delta lands in y
                ops.lora_(part, x, *tables[p], self.ranks[p], self.scale, step)
            col += n_out

    def adapts(self, p: str, step: StepLora) -> bool:
        """Whether an adapter of the step changes projection p (found once per step, for every layer)."""
        adapted = step.adapted.get(p)
        if adapted is None:
            adapted = step.adapted[p] = any(self.rank_of[p][s] for s in step.slots)
        return adapted


def torch_delta_(y: torch.Tensor, x: torch.Tensor, a, b_t, ranks, scale, step: StepLora) -> None:
    """kernels/reference.py's `lora` by slot: for the rows of each slot, y += scale * (x A.T) B.T,
    in float32, rounded once into y's dtype. y may be a column slice of a wider output."""
    for slot, rows in step.by_slot:
        r = int(ranks[slot])
        if r == 0:
            continue
        v = x[rows].float() @ a[slot, :r].float().T  # [rows of the slot, r]
        delta = (v @ b_t[slot, :r].float()) * float(scale[slot])  # [rows of the slot, n_out]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
