"""The hyper-parameters of a Mixture-of-Experts decoder: a dense decoder's, and its experts' layout.

Every family spells them differently (Mixtral `num_local_experts`, the others `num_experts`; Mixtral's
experts are `intermediate_size` wide, Qwen's `moe_intermediate_size`; Qwen picks its dense layers with
`mlp_only_layers` and `decoder_sparse_step`), and a GGUF states fewer of them: which layers are dense
shows only in which tensors a layer has, and whether the routing weights are renormalised in the code
llama.cpp runs for the architecture unless `expert_weights_norm` says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.model_executor.models.decoder_config import DecoderConfig, gguf_fields

if TYPE_CHECKING:
    from llmserve.model_executor.loader.gguf_file import GGUFHeader

# llama.cpp's architecture → whether its code renormalises the top-k weights without a key saying so
_GGUF_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False, "qwen2moe": False}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class MoEConfig(DecoderConfig):
    """`intermediate_size` is the dense layers' width, `moe_intermediate_size` each expert's."""

    num_experts: int = 1
    num_experts_per_tok: int = 1  # top-k: the experts each token's rows go through
    moe_intermediate_size: int = 1
    norm_topk_prob: bool = False  # the k routing weights divided by their sum
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's expert every token takes; 0 for none
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in place of experts

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                f"({self.num_experts})."
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}.")
        if any(not 0 <= i < self.num_hidden_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {self.dense_layers} name layers the model lacks.")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def describe(self) -> str:
        """The expert layout, for the start-up log."""
        sparse = self.num_hidden_layers - len(self.dense_layers)
        shared = f", a shared expert {self.shared_expert_intermediate_size} wide" * bool(
            self.shared_expert_intermediate_size
        )
        return (
            f"{self.num_experts} experts {self.moe_intermediate_size} wide, {self.num_experts_per_tok} per "
            f"token{shared}, in {sparse} of {self.num_hidden_layers} layers"
        )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MoEConfig:
        base = super().from_hf_dict(cfg)
        assert isinstance(base, MoEConfig)
        arch = base.architecture
        qwen2_bias = bool(cfg.get("qkv_bias", True))  # Qwen2-MoE's name for attention_bias
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"{arch} with clip_qkv is not supported (OLMoE-1B-7B does not set it).")
        step = int(cfg.get("decoder_sparse_step", 1))
        only_dense = set(cfg.get("mlp_only_layers") or ())
        layers = range(base.num_hidden_layers)
        return dataclasses.replace(
            base,
            attention_bias=qwen2_bias if arch == "Qwen2MoeForCausalLM" else base.attention_bias,
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or base.intermediate_size),
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            dense_layers=tuple(i for i in layers if i in only_dense or (i + 1) % step),
        )

    @classmethod
    def from_gguf(cls, header: GGUFHeader, architecture: str) -> MoEConfig:
        """From llama.cpp's keys; the experts' tensors must agree with them (`ValueError` naming the one
        that does not)."""
        fields = gguf_fields(header, architecture)
        meta, arch = header.metadata, header.architecture

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"{header.path} lacks the metadata key {arch}.{name!r}.")
            return value

        config = cls(
            **fields,
            num_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length", fields["intermediate_size"])),
            norm_topk_prob=bool(key("expert_weights_norm", _GGUF_NORM_TOPK.get(arch, False))),
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
            dense_layers=tuple(
                i
                for i in range(int(fields["num_hidden_layers"]))
                if f"blk.{i}.ffn_gate_inp.weight" not in header.tensors
            ),
        )
        _check_expert_tensors(header, config)
        return config


def _check_expert_tensors(header: GGUFHeader, config: MoEConfig) -> None:
    """Each sparse layer's router and experts, of the shapes the metadata gives."""
    e, hidden, width = config.num_experts, config.hidden_size, config.moe_intermediate_size
    expected = {
        "ffn_gate_inp": (e, hidden),
        "ffn_gate_exps": (e, width, hidden),
        "ffn_up_exps": (e, width, hidden),
        "ffn_down_exps": (e, hidden, width),
    }
    arch = header.architecture
    for layer in range(config.num_hidden_layers):
        if not config.is_sparse(layer):
            continue
        for part, shape in expected.items():
            name = f"blk.{layer}.{part}.weight"
            info = header.tensors.get(name)
            if info is None:
                raise ValueError(f"{header.path}: tensor {name!r} is missing ({arch}.expert_count is {e}).")
            if info.shape != shape:
                raise ValueError(
                    f"{header.path}: tensor {name!r} has shape {info.shape}, expected {shape} from "
                    f"{arch}.expert_count ({e}) and the feed-forward lengths."
                )
