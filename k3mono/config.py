"""Kimi-K3 configuration: the fields of a checkpoint's config.json that
layer_post depends on, the released values as a preset, small presets for
tests, and the tensor-parallel divisibility rules.

Shape legend (used everywhere in k3mono):
    S tokens, H hidden, E experts, K top-k, L latent, I expert intermediate,
    SI shared intermediate (num_shared_experts * I), T ranks,
    C core width (num_attention_heads * v_head_dim), nb AttnRes blocks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import K3InputError

MXFP4_GROUP = 32
"""Inputs per E8M0 scale in the routed experts' MXFP4 weights."""

MAX_TOKENS = 16
"""Tokens one layer_post call takes: the decode batch the fused launch is built
for (a token tile of the GEMV stages). More is a clear error, never a silent
fallback."""

SUPPORTED_TP = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class K3Config:
    hidden_size: int  # H
    num_attention_heads: int
    v_head_dim: int
    num_experts: int  # E
    num_experts_per_token: int  # K
    moe_intermediate_size: int  # I
    num_shared_experts: int
    routed_expert_hidden_size: int  # L
    rms_norm_eps: float = 1e-5
    attn_res_block_size: int = 12
    num_hidden_layers: int = 93
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    # -- derived sizes ------------------------------------------------------
    @property
    def core_width(self) -> int:  # C
        return self.num_attention_heads * self.v_head_dim

    @property
    def shared_intermediate(self) -> int:  # SI
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def matrix_dims(self) -> tuple[int, int, int, int, int, int]:
        """(H, C, E, L, I, SI): the sizes every weight matrix of a layer is made of."""
        return (self.hidden_size, self.core_width, self.num_experts, self.routed_expert_hidden_size,
                self.moe_intermediate_size, self.shared_intermediate)

    def num_blocks(self, layer: int) -> int:
        """AttnRes blocks visible at the MLP side of ``layer`` (block 0 is the embedding)."""
        return layer // self.attn_res_block_size + 1

    # -- validation ---------------------------------------------------------
    def validate(self) -> None:
        positive = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "int"}
        for name, value in positive.items():
            if name != "first_k_dense_replace" and value <= 0:
                raise K3InputError(f"config {name}: expected a positive integer, got {value}")
        if self.num_experts_per_token > self.num_experts:
            raise K3InputError(
                f"config num_experts_per_token: expected at most num_experts={self.num_experts}, "
                f"got {self.num_experts_per_token}"
            )
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % MXFP4_GROUP:
                raise K3InputError(
                    f"config {name}: expected a multiple of the MXFP4 group {MXFP4_GROUP}, got {getattr(self, name)}"
                )

    def validate_layer(self, layer: int) -> None:
        if not (self.first_k_dense_replace <= layer < self.num_hidden_layers):
            raise K3InputError(
                f"layer: expected an MoE layer in [{self.first_k_dense_replace}, {self.num_hidden_layers}), got {layer}"
            )

    def validate_tp(self, tp: int) -> None:
        """Every rank gets whole heads, experts, latent rows and whole MXFP4 groups."""
        if tp not in SUPPORTED_TP:
            raise K3InputError(f"tp: expected one of {list(SUPPORTED_TP)}, got {tp}")
        divided = {
            "num_attention_heads": self.num_attention_heads,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared intermediate (num_shared_experts * moe_intermediate_size)": self.shared_intermediate,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
        }
        for name, value in divided.items():
            if value % tp:
                raise K3InputError(f"tp={tp} does not divide {name}={value}")
        per_rank = self.moe_intermediate_size // tp
        if per_rank % MXFP4_GROUP:
            raise K3InputError(
                f"tp={tp}: moe_intermediate_size/tp = {per_rank} is not a whole number of "
                f"MXFP4 groups of {MXFP4_GROUP} (w2's input columns would split a scale group)"
            )

    # -- config.json ----------------------------------------------------------
    @classmethod
    def from_json(cls, data: dict) -> "K3Config":
        """Read the released ``text_config`` field names (or top-level ones)."""
        text = data.get("text_config", data)
        _check_supported(text)
        quant = data.get("quantization_config", text.get("quantization_config"))
        _check_quantization(quant)

        def need(name):
            if name not in text:
                raise K3InputError(f"config.json: field text_config.{name} is missing")
            return text[name]

        cfg = cls(
            hidden_size=int(need("hidden_size")),
            num_attention_heads=int(need("num_attention_heads")),
            v_head_dim=int(text.get("v_head_dim", 128)),
            num_experts=int(need("num_experts")),
            num_experts_per_token=int(need("num_experts_per_token")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_shared_experts=int(need("num_shared_experts")),
            routed_expert_hidden_size=int(need("routed_expert_hidden_size")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            attn_res_block_size=int(need("attn_res_block_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            first_k_dense_replace=int(text.get("first_k_dense_replace", 1)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            situ_beta=float(text.get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path) -> "K3Config":
        path = Path(path)
        if not path.is_file():
            raise K3InputError(f"config.json: file {path} not found")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise K3InputError(f"config.json: {path} is not valid JSON ({err})") from None
        return cls.from_json(data)

    def to_json(self) -> dict:
        """A config.json in the released layout (text_config + top-level quantization_config)."""
        text = {
            "model_type": "kimi_k3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "v_head_dim": self.v_head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": 1,
            "topk_group": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "attn_res_block_size": self.attn_res_block_size,
            "hidden_act": "situ",
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "num_hidden_layers": self.num_hidden_layers,
            "first_k_dense_replace": self.first_k_dense_replace,
            "torch_dtype": "bfloat16",
        }
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "text_config": text,
            "quantization_config": QUANTIZATION_CONFIG,
        }


QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "group",
                "group_size": MXFP4_GROUP,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*block_sparse_moe.gate$",
        "re:.*routed_expert_(down|up)_proj$",
        "lm_head",
    ],
}


def _check_supported(text: dict) -> None:
    """The released function only: situ activation, sigmoid router, one group."""
    fixed = {
        "hidden_act": "situ",
        "moe_router_activation_func": "sigmoid",
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
    }
    for name, want in fixed.items():
        if name in text and text[name] != want:
            raise K3InputError(f"config.json: text_config.{name}: expected {want!r}, got {text[name]!r}")
    if text.get("hidden_act", "situ") != "situ":
        raise K3InputError(f"config.json: text_config.hidden_act: expected 'situ', got {text['hidden_act']!r}")
    for name in ("n_group", "topk_group"):
        if int(text.get(name, 1)) != 1:
            raise K3InputError(f"config.json: text_config.{name}: expected 1 (one router group), got {text[name]!r}")


def _check_quantization(quant) -> None:
    if quant is None:
        raise K3InputError("config.json: quantization_config is missing (expected compressed-tensors mxfp4)")
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise K3InputError(f"config.json: quantization_config.quant_method: expected 'compressed-tensors', got {method!r}")
    formats = {quant.get("format")} | {g.get("format") for g in quant.get("config_groups", {}).values()}
    formats.discard(None)
    if formats != {"mxfp4-pack-quantized"}:
        raise K3InputError(
            f"config.json: quantization_config.format: expected 'mxfp4-pack-quantized', got {sorted(formats)}"
        )
    for name, group in quant.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if weights.get("group_size", MXFP4_GROUP) != MXFP4_GROUP or weights.get("num_bits", 4) != 4:
            raise K3InputError(
                f"config.json: quantization_config.config_groups.{name}.weights: expected num_bits 4, "
                f"group_size {MXFP4_GROUP}, got num_bits {weights.get('num_bits')}, group_size {weights.get('group_size')}"
            )


PRESETS = {
    # The released Kimi-K3 text model.
    "kimi-k3": K3Config(
        hidden_size=7168,
        num_attention_heads=96,
        v_head_dim=128,
        num_experts=896,
        num_experts_per_token=16,
        moe_intermediate_size=3072,
        num_shared_experts=2,
        routed_expert_hidden_size=3584,
    ),
    # Interpreter-sized: every dimension keeps the released factor structure
    # (7 * 2^k hidden, 3 * 2^k latent) so masks and non-power-of-two tiles are
    # exercised; T = 4 still leaves one whole MXFP4 group per rank.
    "tiny": K3Config(
        hidden_size=224,
        num_attention_heads=4,
        v_head_dim=32,
        num_experts=56,
        num_experts_per_token=6,
        moe_intermediate_size=128,
        num_shared_experts=2,
        routed_expert_hidden_size=96,
    ),
    # The largest TP the released model admits (16) on CPU-sized weights.
    "small": K3Config(
        hidden_size=448,
        num_attention_heads=16,
        v_head_dim=32,
        num_experts=112,
        num_experts_per_token=8,
        moe_intermediate_size=512,
        num_shared_experts=2,
        routed_expert_hidden_size=224,
    ),
}


def preset(name: str) -> K3Config:
    if name not in PRESETS:
        raise K3InputError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
