"""Frozen, documented training configuration, built from plain data with field-path errors.

`TrainConfig.from_dict(data, where="variants.bf16")` validates every key: unknown keys, wrong
types and out-of-range values raise ValueError naming the path (``variants.bf16.algo.lr: ...``)
and what is accepted. `to_dict()` round-trips. Exercised by `pytest tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# AlgoConfig lives in trainer/algo_config.py; a config is still read from here, whole
from trainer.algo_config import ALGORITHMS, AlgoConfig, unread_algo_keys  # noqa: F401
from trainer.config_base import Section as _Section
from trainer.config_base import check as _check
from trainer.losses import POLICY_LOSS
from trainer.precision import PRESETS, PrecisionPolicy, check_policy, resolve_policy
from trainer.verl_versions import line

SETUP_ROLES = ("*", "actor", "critic", "reference", "reward")
"""Keys of a ``model.setup`` mapping: a role, or ``*`` for every role the run builds."""
TRUNCATIONS = ("error", "left", "right", "middle")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    preset: str | None = "tiny-llama"
    """Architecture preset with random init (`trainer.models.PRESETS`), used when ``path`` is unset."""
    path: str | None = None
    """Local Hugging Face directory of a causal LM (``save_pretrained`` layout); wins over ``preset``."""
    tokenizer: str | None = None
    """Local tokenizer directory; default: the model directory, else the project's own tokenizer."""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields changed on top of the preset (``num_hidden_layers: 2``)."""
    attn_implementation: str = "sdpa"
    """``sdpa``, ``eager`` or ``flash_attention_2``."""
    critic_path: str | None = None
    """Local directory for the critic backbone; default: a copy of the actor's initial weights."""
    reward_model: str | None = None
    """Reward model: a local sequence-classification directory, a preset name, or ``module:attr``
    loader; unset means the task's rule reward (or ``data.reward_fn``)."""
    setup: str | Mapping[str, str] | None = None
    """The user's model code, run on each built model before training (and before any audit
    hook attaches): ``module:attr`` or ``path/to/file.py:attr`` naming ``fn(model, role, tokenizer)``,
    called once per role the run builds (``actor``, ``critic``, ``reference``, ``reward``), or a
    mapping role -> plug-in for some roles only (``{critic: heads.py:fp32_head}``). It may change the
    model in place (a custom head, a forward hook, a modified module) and return None, or return
    the module that replaces it. README "Plug-in points"."""
    compile: bool = False
    """``torch.compile`` every decoder layer (Inductor fuses norms, rotary, SiLU-mul and residual adds
    between the GEMMs) for training and frozen forwards; forwards with a KV cache (rollout) and
    forwards watched by the full audit's hooks stay eager. One process only."""

    def __post_init__(self) -> None:
        _check(self.path is not None or self.preset is not None, "preset", "set model.preset or model.path")
        _check(
            self.attn_implementation in ("sdpa", "eager", "flash_attention_2"),
            "attn_implementation",
            f"{self.attn_implementation!r}; expected sdpa, eager or flash_attention_2",
        )
        for role, spec in self.setup_plugins().items():
            path = "setup" if isinstance(self.setup, str) else f"setup.{role}"
            _check(
                role in SETUP_ROLES, path, f"unknown role {role!r}; expected some of {', '.join(SETUP_ROLES)}"
            )
            _check(
                isinstance(spec, str) and ":" in spec,
                path,
                f"{spec!r}; expected 'package.module:fn' or 'path/to/file.py:fn'",
            )

    def setup_plugins(self) -> dict[str, str]:
        """Role -> ``model.setup`` plug-in; a single plug-in applies to every role (``*``)."""
        if self.setup is None:
            return {}
        if isinstance(self.setup, str):
            return {"*": self.setup}
        return dict(self.setup)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    task: str = "digits"
    """Built-in verifiable task (`trainer.data.TASKS`), ignored when ``dataset`` is set."""
    dataset: str | None = None
    """User dataset as ``module:attr`` or ``path/to/file.py:attr`` (a callable returning a list of
    dicts with ``prompt`` and, for DPO, ``chosen`` / ``rejected``)."""
    collator: str | None = None
    """User collator ``module:attr``: called with (list of examples, tokenizer), returns a dict."""
    reward_fn: str | None = None
    """User reward function ``module:attr``: (prompts, responses, examples) -> rewards."""
    prompt_length: int = 16
    """Maximum prompt tokens (prompts are left-padded to this)."""
    response_length: int = 8
    """Maximum new tokens in rollout; for DPO, maximum completion tokens."""
    num_examples: int = 2048
    """Examples generated by a built-in task."""
    train_files: str | tuple[str, ...] | None = None
    """verl's RL data as it is (verl ``data.train_files``): a ``.parquet``, ``.jsonl`` or ``.json`` file,
    or a list of them. Each row has ``prompt`` (chat messages), ``data_source``,
    ``reward_model: {ground_truth, style}`` and ``extra_info``; prompts are rendered with the tokenizer's
    chat template (`trainer.verl_data`). Replaces ``task`` and ``dataset``; ``prompt_length`` is verl's
    ``max_prompt_length``."""
    prompt_key: str = "prompt"
    """verl ``data.prompt_key``: the column holding each row's chat messages."""
    truncation: str = "error"
    """verl ``data.truncation`` for prompts longer than ``prompt_length`` tokens: ``error`` (refused before
    training starts), ``left`` (keep the end), ``right`` (keep the start) or ``middle`` (keep both ends)."""
    filter_overlong_prompts: bool = False
    """verl ``data.filter_overlong_prompts``: drop rows whose rendered prompt exceeds ``prompt_length``
    tokens before training (verl's ppo_trainer.yaml default: false)."""
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """verl ``data.apply_chat_template_kwargs``: extra arguments to ``apply_chat_template``
    (``enable_thinking: false``)."""
    reward_fn_key: str = "data_source"
    """verl ``data.reward_fn_key``: the column passed to the reward function as ``data_source``."""
    compute_score: str | None = None
    """verl's reward function as it is (verl ``custom_reward_function.path`` and ``.name``), as
    ``path/to/file.py:compute_score`` or ``module:attr``: called per response as
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``, returning a number or a dict
    with ``score`` (its other numeric keys become ``reward_extra/<key>/mean`` metrics). Unset with
    ``train_files``: the built-in rule scorer of the rows' ``data_source`` (``openai/gsm8k``)."""
    compute_score_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """verl ``custom_reward_function.reward_kwargs``: keyword arguments added to every call."""

    def __post_init__(self) -> None:
        _check(self.prompt_length > 0, "prompt_length", f"must be > 0, got {self.prompt_length}")
        _check(self.response_length > 0, "response_length", f"must be > 0, got {self.response_length}")
        _check(self.num_examples > 0, "num_examples", f"must be > 0, got {self.num_examples}")
        _check(
            self.truncation in TRUNCATIONS,
            "truncation",
            f"{self.truncation!r}; expected one of {', '.join(TRUNCATIONS)} (verl data.truncation)",
        )
        _check(bool(self.prompt_key), "prompt_key", "must name a column, got an empty string")
        files = (self.train_files,) if isinstance(self.train_files, str) else self.train_files or ()
        _check(
            all(isinstance(f, str) and f for f in files),
            "train_files",
            f"expected a file path or a list of paths, got {self.train_files!r}",
        )
        _check(
            self.train_files is None or len(files) > 0, "train_files", "an empty list; name at least one file"
        )
        if self.train_files is not None:
            _check(
                self.dataset is None,
                "dataset",
                "set either data.dataset (user code) or data.train_files (verl's data files), not both",
            )
            _check(
                self.reward_fn is None,
                "reward_fn",
                "verl rows are scored by data.compute_score (verl's signature); remove data.reward_fn",
            )
        else:
            _check(
                self.compute_score is None and not self.compute_score_kwargs,
                "compute_score",
                "verl's compute_score needs verl's rows (data_source, reward_model.ground_truth): set "
                "data.train_files, or use data.reward_fn for other data",
            )

    @property
    def train_file_list(self) -> tuple[str, ...]:
        """``train_files`` as a tuple (empty when unset)."""
        return (self.train_files,) if isinstance(self.train_files, str) else tuple(self.train_files or ())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Section):
    preset: str = "fp32"
    """``fp32``, ``fp16``, ``bf16`` or ``bf16-pure`` (`trainer.precision`)."""
    overrides: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Per-role fields on top of the preset: ``{critic: {compute_dtype: bf16}}``."""
    grad_checkpointing: bool | Mapping[str, bool] = False
    """On for all trainable roles, or per role: ``{actor: true, critic: false}``."""
    checkpoint_layers: int | str | None = None
    """Selective checkpointing: checkpoint only the first N decoder layers (unset: all of them).
    ``auto`` is resolved by ``verlaudit run`` from the memory planner (fewest checkpointed layers
    that fit the target GPU); the trainer itself needs a number."""

    def __post_init__(self) -> None:
        _check(
            self.preset in PRESETS,
            "preset",
            f"unknown preset {self.preset!r}; expected one of {', '.join(PRESETS)}",
        )
        auto = self.checkpoint_layers == "auto"
        if auto:
            _check(
                self.grad_checkpointing is not False,
                "checkpoint_layers",
                "auto needs grad_checkpointing: true",
            )
        # the fields are checked here; the policy is built once, by whoever runs it (`build_policy`)
        check_policy(
            self.preset,
            self.overrides,
            grad_checkpointing=self.grad_checkpointing,
            checkpoint_layers=None if auto else self.checkpoint_layers,  # type: ignore[arg-type]
            where="",
        )

    def build_policy(self, device: Any = "cpu", *, where: str = "precision") -> PrecisionPolicy:
        """The `trainer.precision.PrecisionPolicy` these fields describe, refused (ValueError naming
        ``where``) when ``device`` cannot run it (bf16 on a GPU without bf16). Built once per run:
        by `verlaudit.run.runner.run_spec` (which checks the target's bf16 itself), or by
        `trainer.common.resolve` when the trainer runs alone."""
        if self.checkpoint_layers == "auto":
            raise ValueError(
                "precision.checkpoint_layers: auto is chosen by `verlaudit run` from the memory planner "
                "before the trainer starts; run the trainer directly with a number of layers"
            )
        return resolve_policy(
            self.preset,
            self.overrides,
            grad_checkpointing=self.grad_checkpointing,
            checkpoint_layers=self.checkpoint_layers,  # type: ignore[arg-type]
            device=device,
            where=where,
        )


ENGINES = ("hf", "static", "fused", "vllm")
"""Rollout engines: ``hf`` (HF ``generate``), ``static`` (our decode loop over a preallocated cache),
``fused`` (that loop over our own fused forward), ``vllm`` (vLLM in-process, weights pushed per step)."""


def resolve_engine(
    engine: str, *, cuda_graphs: bool = False, compile: bool = False, where: str = "rollout"
) -> str:
    """``engine``, checked (`ENGINES`) with the options that need our static-cache decode loop;
    ValueError naming ``where``."""
    at = f"{where}." if where else ""
    if engine not in ENGINES:
        raise ValueError(f"{at}engine: {engine!r}; expected one of {', '.join(ENGINES)}")
    for key, on in (("cuda_graphs", cuda_graphs), ("compile", compile)):
        if on and engine not in ("static", "fused"):
            raise ValueError(
                f"{at}{key}: needs rollout.engine: static or fused, not rollout.engine: {engine}"
            )
    return engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(_Section):
    _renamed = {
        "cache": "replaced by rollout.engine (cache: dynamic is engine: hf, cache: static is engine: static); "
        "remove rollout.cache",
        "fused": "replaced by rollout.engine: fused (it was fused: true with cache: static); remove rollout.fused",
    }

    engine: str = "hf"
    """``hf`` (HF ``generate``), ``static`` (our decode loop over a preallocated KV cache), ``fused``
    (that loop over our own forward, `trainer.fused_decode`, Llama / Mistral / Qwen2 layouts: a snapshot
    of the actor's weights cast to the rollout dtype once per rollout, q/k/v and gate/up fused into one
    GEMM each, attention reading only the written cache slots: what an inference engine loaded with the
    synced weights computes) or ``vllm`` (vLLM in-process, weights pushed per step). `ENGINES`."""
    cuda_graphs: bool = False
    """Capture the single-token decode step as a CUDA graph (needs ``engine: static`` or ``fused`` and
    CUDA; not with several ranks, where each decode step contains FSDP2 all-gathers that cannot be
    captured, except ``fused``)."""
    compile: bool = False
    """``torch.compile`` (Inductor, whole graph, static shapes) the single-token decode forward of
    ``engine: static`` / ``fused``, so norms, rotary, SiLU-mul and residual adds fuse between the GEMMs;
    with ``cuda_graphs`` the compiled step is captured too. Compiles once per process and batch shape
    (tens of seconds for a 7B model; the prefill stays eager)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (after
    ``algo.temperature`` and ``algo.top_k``), every engine; 1 disables. The recorded rollout log-probs
    are those of the distribution actually sampled from (renormalised over the kept tokens)."""
    vllm_kv_cache_gib: int = 1
    """``engine: vllm`` on CPU: KV-cache size in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_probe_tokens: int = 16
    """``engine: vllm``: after each weight push, the engine's teacher-forced log-probs of this many
    fixed tokens are compared with the actor's own (``rollout/weight_sync_probe_*``); 0 skips it."""

    @property
    def kind(self) -> str:
        """The engine (`ENGINES`): ``engine``, under the name the recipes read."""
        return self.engine

    def __post_init__(self) -> None:
        resolve_engine(self.engine, cuda_graphs=self.cuda_graphs, compile=self.compile, where="")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.vllm_kv_cache_gib >= 1, "vllm_kv_cache_gib", f"must be >= 1, got {self.vllm_kv_cache_gib}"
        )
        _check(
            self.vllm_probe_tokens >= 0, "vllm_probe_tokens", f"must be >= 0, got {self.vllm_probe_tokens}"
        )


ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""verl's ``rollout_rs`` options: a divergence estimator (k1 = log rollout/train ratio, k2, k3) per
token, or its sum / mean / max over each sequence."""
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""verl's ``rollout_correction.loss_type`` values (the loss under ``bypass_mode``)."""
ROLLOUT_RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""verl's earlier ``rollout_rs`` names (ratio bounds [1/C, C] per token, on the sequence's product
of ratios, on their geometric mean): the same tests as these k1 options with ``C`` as threshold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig(_Section):
    """verl's ``algorithm.rollout_correction`` (its names and defaults): importance weights and
    rejection of tokens / sequences where the rollout engine's log-probs disagree with the trainer's
    recomputed ones (`trainer.mismatch.rollout_correction`). The defaults correct nothing; the
    mismatch metrics are logged for every engine either way."""

    rollout_is: str | None = None
    """Truncated importance sampling: ``token`` (w_t = min(pi_train / pi_rollout, C) per token) or
    ``sequence`` (the product over the sequence, truncated at C, on every token); unset: none.
    The weights (detached) multiply each token's policy-gradient loss."""
    rollout_is_threshold: str | float = 2.0
    """C, the truncation of the importance weights (verl's default 2.0; TIS), or a string ``lower_upper``
    (``"0.5_5.0"``; IcePop, verl 0.8 on): weights outside [lower, upper] become 0, the others stay as they
    are (read as a string first: Python's float() takes ``0.5_2`` for 0.52). Also the bound of the
    always-on ``rollout_corr/token_ratio_fraction_outside`` metric ([1/C, C], C the upper bound)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (per token or per sequence), so they average 1."""
    rollout_rs: str | None = None
    """Rejection (masking): comma-separated `ROLLOUT_RS_OPTIONS` (or verl's earlier ``token``,
    ``sequence``, ``geometric``); a token or sequence failing any of them leaves the response mask used
    by the advantages and both updates. Unset: none."""
    rollout_rs_threshold: str | float | None = None
    """Required with ``rollout_rs``: one threshold for all options or one per option (comma-separated).
    k1 options take ratio bounds ``lower_upper`` or one upper bound U (lower 1/U); k2 / k3 options an
    upper bound on the divergence."""
    bypass_mode: bool = False
    """verl's bypass mode: the rollout engine's log-probs are the old ones (two policies, not three), and
    the correction above runs inside the loss (``algo.loss_mode: bypass_mode``, `trainer.losses`), per
    micro-batch, against the current log-probs; the advantages see the whole response mask. The trainer's
    log-probs are still computed once per step here, for the mismatch metrics only."""
    loss_type: str = "ppo_clip"
    """Under ``bypass_mode``: ``ppo_clip`` (the clipped surrogate against the rollout's log-probs, IS weights
    not applied) or ``reinforce`` (-w A logp with the IS weights w)."""

    def __post_init__(self) -> None:
        self.is_bounds()  # validates rollout_is_threshold
        _check(
            self.loss_type in BYPASS_LOSS_TYPES,
            "loss_type",
            f"{self.loss_type!r}; expected one of {', '.join(BYPASS_LOSS_TYPES)}",
        )
        _check(
            self.bypass_mode or self.loss_type == "ppo_clip",
            "loss_type",
            f"set to {self.loss_type!r} but nothing reads it: needs bypass_mode: true",
        )
        if self.rollout_is is not None:
            _check(
                self.rollout_is in ROLLOUT_IS_LEVELS,
                "rollout_is",
                f"{self.rollout_is!r}; expected token, sequence or null",
            )
        if self.rollout_rs is None:
            _check(self.rollout_rs_threshold is None, "rollout_rs_threshold", "set without rollout_rs")
            return
        _check(
            self.rollout_rs_threshold is not None,
            "rollout_rs_threshold",
            f"required with rollout_rs: {self.rollout_rs} (verl has no default)",
        )
        self.rs_thresholds()  # validates the options and their thresholds once, here

    def is_bounds(self) -> tuple[float | None, float]:
        """``rollout_is_threshold`` as (lower, upper): (None, C) for a number (TIS), (lower, upper) for a
        ``lower_upper`` string (IcePop), verl's parsing (a number-like string is a number)."""
        spec = self.rollout_is_threshold
        _check(
            not isinstance(spec, bool), "rollout_is_threshold", "expected a number or lower_upper, got a bool"
        )
        parts = spec.strip().split("_", 1) if isinstance(spec, str) else [spec]
        try:
            nums = [float(x) for x in parts]
        except ValueError:
            raise ValueError(
                f"rollout_is_threshold: {spec!r} is not a number or lower_upper (e.g. 2.0 or '0.5_5.0')"
            ) from None
        lower, upper = (None, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
        _check(upper > 0, "rollout_is_threshold", f"must be > 0, got {spec!r}")
        _check(
            lower is None or 0 < lower <= upper, "rollout_is_threshold", f"{spec!r}: needs 0 < lower <= upper"
        )
        return lower, upper

    def rs_options(self) -> list[str]:
        """The ``rollout_rs`` options, aliases resolved, in order, without repeats."""
        out: list[str] = []
        for raw in str(self.rollout_rs or "").split(","):
            opt = ROLLOUT_RS_ALIASES.get(raw.strip(), raw.strip())
            if not opt:
                continue
            _check(
                opt in ROLLOUT_RS_OPTIONS,
                "rollout_rs",
                f"unknown option {raw.strip()!r}; expected some of {', '.join(ROLLOUT_RS_OPTIONS)} "
                f"(or {', '.join(ROLLOUT_RS_ALIASES)})",
            )
            if opt not in out:
                out.append(opt)
        _check(bool(out), "rollout_rs", "names no option")
        return out

    def rs_thresholds(self) -> dict[str, tuple[float | None, float]]:
        """``option -> (lower, upper)``: ratio bounds for k1 options, (None, max divergence) otherwise."""
        options = self.rs_options()
        spec = self.rollout_rs_threshold
        parts = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
        _check(
            len(parts) in (1, len(options)),
            "rollout_rs_threshold",
            f"{len(parts)} thresholds for {len(options)} rollout_rs options; give one, or one per option",
        )
        parts = parts * len(options) if len(parts) == 1 else parts
        out: dict[str, tuple[float | None, float]] = {}
        for opt, part in zip(options, parts):
            try:
                nums = [float(x) for x in part.split("_")]
            except ValueError:
                raise ValueError(f"rollout_rs_threshold: {part!r} for {opt} is not a number") from None
            k1 = opt.endswith("k1")
            _check(
                len(nums) == 1 or (k1 and len(nums) == 2),
                "rollout_rs_threshold",
                f"{part!r} for {opt}: " + ("lower_upper or one upper bound" if k1 else "one upper bound"),
            )
            _check(all(n > 0 for n in nums), "rollout_rs_threshold", f"{part!r} for {opt}: must be > 0")
            if k1:
                lower, upper = (nums[0], nums[1]) if len(nums) == 2 else (1.0 / nums[0], nums[0])
                _check(lower < upper, "rollout_rs_threshold", f"{part!r} for {opt}: lower must be < upper")
                out[opt] = (lower, upper)
            else:
                out[opt] = (None, nums[0])
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """verl's ``algorithm.rollout_correction``: importance weights / rejection against the rollout
    engine's mismatch (PPO and GRPO)."""
    steps: int = 20
    """Training steps (one rollout batch + its update epochs, or one DPO batch)."""
    seed: int = 0
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = 0
    """CPU threads for torch (0: leave torch's default)."""
    abort_on_nonfinite_loss: int = 0
    """Stop the run after this many consecutive non-finite losses (0: never)."""
    sharding: str = "full_shard"
    """Several processes (torchrun): ``full_shard`` (FSDP2 reshard_after_forward=True, least memory)
    or ``shard_grad_op`` (parameters stay gathered from forward to backward: fewer all-gathers, one
    full copy of the gathered parameters held per layer until its backward). Ignored by one process."""
    origin: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Where this config was imported from, as plain data (``verlaudit from-verl`` records the verl launch
    script's overrides under ``verl``). The trainer does not read it: it travels into each run's manifest,
    so a diagnosis can name its fixes in the source's own keys and lines."""

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            f"{self.device!r}; expected auto, cpu, cuda or cuda:N",
        )
        # literal keys of trainer.distributed.SHARDING: config must not import torch.distributed
        _check(
            self.sharding in ("full_shard", "shard_grad_op"),
            "sharding",
            f"{self.sharding!r}; expected full_shard or shard_grad_op",
        )
        rc = self.rollout_correction
        if rc.rollout_is is not None or rc.rollout_rs is not None or rc.bypass_mode:
            _check(
                self.algo.name != "dpo",
                "rollout_correction",
                "DPO has no rollout to correct; remove rollout_correction",
            )
        # the IS weights scale each token's advantage (trainer.mismatch.weighted_advantages): not for a loss
        # that is not per token in the advantage (registered with token_weights=False)
        _check(
            rc.rollout_is is None or POLICY_LOSS.entry(self.algo.loss_mode).info.get("token_weights", True),
            "rollout_correction.rollout_is",
            f"not with algo.loss_mode: {self.algo.loss_mode} yet (it selects tokens by the advantages or averages "
            "them per sequence, which the weights would change); use rollout_rs alone, or another loss_mode",
        )
        # verl replaces the actor's loss_mode by bypass_mode under bypass_mode: here it is said, not replaced
        bypass = self.algo.loss_mode == "bypass_mode"
        _check(
            bypass == rc.bypass_mode or self.algo.name == "dpo",
            "algo.loss_mode" if rc.bypass_mode else "rollout_correction.bypass_mode",
            f"{self.algo.loss_mode} with rollout_correction.bypass_mode: {str(rc.bypass_mode).lower()}; the "
            "bypass loss and bypass mode go together (verl sets the one from the other): set both or neither",
        )
        _check(
            rc.is_bounds()[0] is None or line(self.algo.verl_version) >= (0, 8),
            "rollout_correction.rollout_is_threshold",
            f"lower_upper (IcePop) is verl 0.8's on; algo.verl_version {self.algo.verl_version} has only a number",
        )
        built = self.roles()
        for role in self.model.setup_plugins():
            _check(
                role == "*" or role in built,
                f"model.setup.{role}",
                f"this run builds no {role} model (it builds {', '.join(built)}); drop the entry",
            )

    def roles(self) -> tuple[str, ...]:
        """The models this run builds: the actor, the critic (PPO), the frozen reference (DPO or a KL
        term) and a reward model (``model.reward_model``, not for DPO)."""
        algo = self.algo
        return (
            ("actor",)
            + ("critic",) * (algo.name == "ppo")
            + ("reference",) * algo.uses_reference
            + ("reward",) * (algo.name != "dpo" and self.model.reward_model is not None)
        )
