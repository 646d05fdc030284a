"""Engine configuration: frozen dataclasses, validated on construction.

`EngineArgs` is the flat form users and the CLI see (one field, one flag); `EngineConfig` groups it for
the components. Values only known after loading the model (the KV block count, the final
max_model_len) live in `ResolvedLimits`, never written back into these.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

DEFAULT_MODEL = "smollm2-135m-instruct"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
Quantization = Literal["none", "gguf", "fp16", "int8", "int4"]
SchedulingPolicy = Literal["fcfs", "priority"]
# vLLM's --kv-cache-dtype: auto keeps the model's dtype; bfloat16 stores an fp32 model's keys and values in
# half the bytes, rounded once as they are written (the CPU's attention kernels compute in fp32 either way)
KVCacheDtype = Literal["auto", "bfloat16"]
# vLLM's --data-parallel-backend: mp starts the ranks as local processes, ray as actors on a Ray cluster
DataParallelBackend = Literal["mp", "ray"]
# vLLM's --runner: generate (sample tokens) or pooling (embed the prompt); auto: pooling for an encoder
# architecture (BertModel), generate for the rest
Runner = Literal["auto", "generate", "pooling"]
ResolvedRunner = Literal["generate", "pooling"]


def check_choice(name: str, value: object, choices: Any) -> None:
    """That `value` is one of the `Literal` type `choices`, which names them once for the type checker,
    the flags and this check."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}.")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Collection[str] | None = None,
    env: str | None = None,
) -> Any:
    """A field declared with its flag's help (`entrypoints/flags.py` makes the flag); `flag` where it is
    not `--field-name`, `choices` for a string, and `env`, a variable read when the flag is not given."""
    metadata = {"help": help, "flag": flag, "choices": choices, "env": env}
    return dataclasses.field(default=default, metadata=metadata)


def restated(config: type, name: str) -> Any:
    """`EngineArgs`' copy of a sub-config's field: the same default and help, declared there once."""
    source = next(f for f in dataclasses.fields(config) if f.name == name)
    return dataclasses.field(default=source.default, metadata=source.metadata)


@dataclass(frozen=True)
class ModelConfig:
    model: str = option(DEFAULT_MODEL, "a GGUF file, a Hugging Face folder or a packaged model's name")
    dtype: Dtype = option("auto", "the compute dtype; auto: float32 on CPUs, bfloat16 on CUDA")
    device: Device = option("auto", "auto: CUDA where torch sees it, else the CPU")
    max_model_len: int | None = option(
        None, "the longest sequence; default: the model's, capped by the KV pool"
    )
    seed: int = option(0, "seeds the weights' random parts and unseeded sampling")
    chat_template: str | None = option(
        None, "a Jinja chat template, or a file holding one; overrides the model's"
    )
    max_logprobs: int = option(20, "the largest `logprobs` a request may ask for (-1: no limit)")
    quantization: Quantization = option(
        "none",
        "CPU, float32, our C kernels (quantization.py): gguf keeps a GGUF's blocks and rounds the "
        "activations to int8 per block of 32, as llama.cpp does; int8 and int4 round the weights into "
        "blocks of 32 too; fp16 keeps 2-byte weights",
    )
    num_threads: int | None = option(
        None, "the engine core's compute threads; default OMP_NUM_THREADS, else all cores"
    )
    native_kernels: bool = option(
        True, "our C kernels on the CPU in float32 where they build; else PyTorch's"
    )
    runner: Runner = option(
        "auto", "generate tokens or pool the prompt (embeddings); auto: pooling for encoders"
    )

    def __post_init__(self) -> None:
        check_choice("runner", self.runner, Runner)
        check_choice("dtype", self.dtype, Dtype)
        check_choice("device", self.device, Device)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        check_choice("quantization", self.quantization, Quantization)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory: int | None = option(
        None, "bytes for the KV pool; default on CPUs: a quarter of available memory, at most 4 GiB"
    )
    enable_prefix_caching: bool = option(
        True, "share the KV blocks of a common prompt prefix between requests"
    )
    kv_cache_dtype: KVCacheDtype = option(
        "auto", "bfloat16: a float32 model's keys and values in half the bytes, rounded once when written"
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KVCacheDtype)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "the most sequences running in one step")
    max_num_batched_tokens: int = option(
        2048, "the most tokens computed in one step (longer prompts go in chunks)"
    )
    scheduling_policy: SchedulingPolicy = option(
        "fcfs",
        "fcfs: arrival order; priority: lower `priority` first, then arrival, and when KV blocks run out "
        "the running request last in that order is preempted instead of the newest",
    )
    max_queue_time: float | None = option(
        None,
        "seconds a request may wait before it is first scheduled; past that it ends unrun (queue_timeout, "
        "a 503 from the server); default: as long as it takes",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        if self.max_queue_time is not None and not self.max_queue_time > 0:
            raise ValueError(f"max_queue_time must be positive, got {self.max_queue_time}.")

    def check_priority(self, priority: object) -> None:
        """vLLM's rule: a request's priority means something only under the priority policy, so any
        other value than 0 is refused there rather than ignored."""
        if type(priority) is not int or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                "priority); this engine schedules first come, first served."
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism: `data_parallel_size` engine cores, each with its own KV pool and threads, behind
    one front end that balances requests over them (see engine/dp_client.py)."""

    data_parallel_size: int = option(1, "engine cores, each with its own KV pool and threads")
    data_parallel_backend: DataParallelBackend = option(
        "mp", "mp: the cores as local processes; ray: as actors on the cluster RAY_ADDRESS names"
    )

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}.")
        check_choice("data_parallel_backend", self.data_parallel_backend, DataParallelBackend)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Bounds on a request's JSON schema, regex, choice or grammar (see structured_output/limits.py),
    checked before the grammar library sees it: past them a request is refused, naming the limit. Depth
    counts each nested object, array, `$ref` hop, rule reference and parenthesised group; alternatives
    count the items of one `choice`, `enum`, `anyOf` or `|` alternation. `grammar_timeout` (seconds)
    bounds a grammar's validation, after which the request fails alone."""

    max_grammar_bytes: int = option(1 << 20, "the largest schema, regex, choice or grammar")
    max_grammar_depth: int = option(128, "the deepest nesting of a structured output's grammar")
    max_grammar_rules: int = option(2000, "the most rules of a Lark or GBNF grammar")
    max_grammar_alternatives: int = option(
        10_000, "the most items of one choice, enum, anyOf or | alternation"
    )
    grammar_timeout: float = option(10.0, "seconds a grammar's validation may take before its request fails")

    def __post_init__(self) -> None:
        for name in (
            "max_grammar_bytes",
            "max_grammar_depth",
            "max_grammar_rules",
            "max_grammar_alternatives",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if not self.grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be positive, got {self.grammar_timeout}.")


SpeculativeMethod = Literal["ngram"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: each decode step checks up to `num_speculative_tokens` guessed
    tokens in the same forward pass (see spec_decode/). `ngram` guesses the tokens that followed the
    latest earlier occurrence of the request's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) in its prompt and output. Where one bound is given the other defaults to it,
    where neither both are 5, as in vLLM.

    Speculation pays only while a step is bound by reading the weights: a step of more than
    `disable_by_batch_size` running requests speculates for none of them, and a request whose guesses
    keep failing stops guessing for a while (spec_decode/speculator.py). None means 2 (vLLM's None means
    never): on a 2-core CPU a guess costs about as much as another sequence's token; on a machine with
    more compute per byte of weights read, measure with `python -m benchmarks.spec_decode
    --disable-by-batch-size N` and raise it."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, SpeculativeMethod)
        if type(self.num_speculative_tokens) is not int or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be a positive integer, got "
                f"{self.num_speculative_tokens!r}."
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if type(value) is not int or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")
        assert low is not None and high is not None
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})."
            )
        limit = self.disable_by_batch_size
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive integer, got {limit!r}."
            )

    @property
    def speculating_batch_size(self) -> int:
        """The most running requests at which a step still guesses."""
        return 2 if self.disable_by_batch_size is None else self.disable_by_batch_size

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From `LLM(speculative_config={...})` or the flag's JSON; unknown fields are refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}."
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name} is required.")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    multiprocess: bool = True


@dataclass(frozen=True)
class ResolvedLimits:
    """What the engine core settled on after loading the model and sizing the KV pool."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    runner: ResolvedRunner = "generate"  # pooling: the engine embeds prompts and generates nothing


@dataclass(frozen=True)
class EngineArgs:
    """Every engine option, flat: `LLM(**kwargs)` and the CLI flags are generated from these fields."""

    model: str = restated(ModelConfig, "model")
    dtype: Dtype = restated(ModelConfig, "dtype")
    device: Device = restated(ModelConfig, "device")
    max_model_len: int | None = restated(ModelConfig, "max_model_len")
    seed: int = restated(ModelConfig, "seed")
    chat_template: str | None = restated(ModelConfig, "chat_template")
    max_logprobs: int = restated(ModelConfig, "max_logprobs")
    quantization: Quantization = restated(ModelConfig, "quantization")
    num_threads: int | None = restated(ModelConfig, "num_threads")
    native_kernels: bool = restated(ModelConfig, "native_kernels")
    runner: Runner = restated(ModelConfig, "runner")
    block_size: int = restated(CacheConfig, "block_size")
    kv_cache_memory: int | None = restated(CacheConfig, "kv_cache_memory")
    enable_prefix_caching: bool = restated(CacheConfig, "enable_prefix_caching")
    kv_cache_dtype: KVCacheDtype = restated(CacheConfig, "kv_cache_dtype")
    max_num_seqs: int = restated(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = restated(SchedulerConfig, "max_num_batched_tokens")
    scheduling_policy: SchedulingPolicy = restated(SchedulerConfig, "scheduling_policy")
    max_queue_time: float | None = restated(SchedulerConfig, "max_queue_time")
    data_parallel_size: int = restated(ParallelConfig, "data_parallel_size")
    data_parallel_backend: DataParallelBackend = restated(ParallelConfig, "data_parallel_backend")
    speculative_config: dict[str, Any] | str | None = option(
        None,
        'vLLM\'s, as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} (see SpeculativeConfig)',
    )
    max_grammar_bytes: int = restated(StructuredOutputsConfig, "max_grammar_bytes")
    max_grammar_depth: int = restated(StructuredOutputsConfig, "max_grammar_depth")
    max_grammar_rules: int = restated(StructuredOutputsConfig, "max_grammar_rules")
    max_grammar_alternatives: int = restated(StructuredOutputsConfig, "max_grammar_alternatives")
    grammar_timeout: float = restated(StructuredOutputsConfig, "grammar_timeout")
    multiprocess: bool = option(True, "run the engine core in its own process (False: in the caller's)")

    def create_engine_config(self) -> EngineConfig:
        def pick(cls: type) -> dict[str, object]:
            names = {f.name for f in dataclasses.fields(cls)}
            return {k: v for k, v in dataclasses.asdict(self).items() if k in names}

        return EngineConfig(
            model_config=ModelConfig(**pick(ModelConfig)),  # type: ignore[arg-type]
            cache_config=CacheConfig(**pick(CacheConfig)),  # type: ignore[arg-type]
            scheduler_config=SchedulerConfig(**pick(SchedulerConfig)),  # type: ignore[arg-type]
            parallel_config=ParallelConfig(**pick(ParallelConfig)),  # type: ignore[arg-type]
            speculative_config=SpeculativeConfig.parse(self.speculative_config),
            structured_outputs_config=StructuredOutputsConfig(**pick(StructuredOutputsConfig)),  # type: ignore[arg-type]
            multiprocess=self.multiprocess,
        )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine option(s): {', '.join(unknown)}.")
        return cls(**kwargs)  # type: ignore[arg-type]
