"""Real MoE architecture shapes (from the published configs) with random weights, and a tiny one for CI."""
from __future__ import annotations

import torch

from ..config import DEFAULT_INT4_GROUP
from ..store import convert, hold_quantized, kernel_view, return_freed_memory

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy",
        routed_scaling_factor=1.0, tie_word_embeddings=False,
    ),
    "olmoe-1b-7b": dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
    ),
}


def preset_config(name: str, layers: int | None = None):
    """The transformers config of preset ``name``, shortened to ``layers`` decoder layers if given."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if fields["model_type"] == "gpt_oss":
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(fields["num_hidden_layers"])]
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# Tensors above this many elements (expert stacks, embeddings) are filled by tiling one random block instead of
# drawing every value: drawing 29 billion normals for a 48-layer Qwen3-30B-A3B took about two minutes, tiling
# takes seconds, and the step time of a benchmark does not depend on the values.
_DRAWN_ELEMENTS = 1 << 24

# With N(0, 0.02) everywhere the residual stream is soon dominated by attention outputs that average over the
# context and look alike for every token, and the routers send most tokens to a few experts: 2048 tokens reached
# 40 of Qwen3's 128 experts per layer after the first few layers, the busiest 15x the mean. That flatters
# co-compute (fewer expert weights to read) and no trained model routes like that. Token-specific embeddings
# that dominate the residual stream spread them out: all 128 experts, busiest about 1.3x the mean.
_EMBEDDING_STD = 1.0
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj", "down_proj.weight")


def _fill_random(param: torch.Tensor, block: torch.Tensor, generator: torch.Generator) -> None:
    """N(0, 0.02) values: drawn for small tensors, tiled from ``block`` (at a random offset) for large ones."""
    flat = param.view(-1)
    if flat.numel() <= _DRAWN_ELEMENTS:
        flat.copy_(torch.randn(flat.shape, generator=generator) * 0.02)
        return
    offset = int(torch.randint(0, block.numel(), (1,), generator=generator))
    source = torch.cat([block[offset:], block[:offset]]).to(param.dtype)
    for start in range(0, flat.numel(), source.numel()):
        piece = flat[start:start + source.numel()]
        piece.copy_(source[:piece.numel()])


def random_model(name: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, expert_format: str = "auto",
                 int4_group_size: int = DEFAULT_INT4_GROUP) -> torch.nn.Module:
    """A preset's causal LM in host memory with random weights, built without transformers' slow init.

    Linear-like weights get N(0, 0.02) (large tensors repeat one random block of 2^24 values from a random
    offset), norms 1, biases 0; non-persistent buffers (rotary tables) are computed as usual. So that tokens are
    routed as in a trained model (spread over all experts, not piled on a few), embeddings get N(0, 1) and the
    projections that write into the residual stream are scaled by 1/sqrt(2 x layers), as GPT-2 initialises them.

    A quantized ``expert_format`` (``MoeccConfig.expert_format``: ``"int4"``, ``"int8"``, ``"fp8"``, ``"mxfp4"``;
    ``dtype`` must be bfloat16) builds the routed experts straight into it, one projection at a time: host memory
    never holds more than one projection's bf16 values beside the quantized copies, and the values are those the
    bf16 model of the same seed holds (``moecc.prepare`` with that format then quantizes nothing).
    """
    from transformers import AutoModelForCausalLM

    config = preset_config(name, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts_of = _quantized_expert_owners(model, expert_format, int4_group_size)
    _materialize(model, skip=set(experts_of))
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(_DRAWN_ELEMENTS, generator=generator) * 0.02
    branch_scale = (2 * config.num_hidden_layers) ** -0.5
    with torch.no_grad():
        for param_name, param in list(model.named_parameters()):
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in param_name else 0.0)
                continue
            values = torch.empty(param.shape, dtype=param.dtype) if id(param) in experts_of else param
            _fill_random(values, block, generator)
            if "embed_tokens" in param_name:
                values.mul_(_EMBEDDING_STD / 0.02)
            elif param_name.endswith(_RESIDUAL_OUTPUTS):
                values.mul_(branch_scale)
            if id(param) in experts_of:
                experts, attr = experts_of[id(param)]
                hold_quantized(experts, attr, convert(kernel_view(experts, values), expert_format, int4_group_size),
                               dtype)
                del values
    if experts_of:
        return_freed_memory()
    for module_name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = module_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config=model.config))
    return model.train()


def _quantized_expert_owners(model: torch.nn.Module, expert_format: str,
                             group: int) -> dict[int, tuple[torch.nn.Module, str]]:
    """``{id(parameter): (experts module, name)}`` of the routed experts' weights (still on the meta device) that
    ``expert_format`` holds quantized; empty for ``"auto"`` and ``"bf16"``. A format the model cannot take is
    refused here, with ``moecc.prepare``'s message, before anything is allocated."""
    from ..models import family_for
    from ..store import EXPERT_PARAMETERS, target_format

    if expert_format in ("auto", "bf16"):
        return {}
    block_class = family_for(model).block_class()
    owners = {}
    for layer_name, block in model.named_modules():
        if isinstance(block, block_class) and target_format(block.experts, layer_name, expert_format, group):
            owners.update({id(block.experts._parameters[attr]): (block.experts, attr) for attr in EXPERT_PARAMETERS})
    return owners


def _materialize(model: torch.nn.Module, skip: set[int]) -> None:
    """Every meta-device parameter and buffer but those whose ids are in ``skip`` as uninitialised host tensors
    (``Module.to_empty`` for part of a model); a tensor shared by two modules stays shared."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or tensor.device.type != "meta" or id(tensor) in skip:
                    continue
                if id(tensor) not in done:
                    empty = torch.empty_like(tensor, device="cpu")
                    done[id(tensor)] = (torch.nn.Parameter(empty, tensor.requires_grad)
                                        if isinstance(tensor, torch.nn.Parameter) else empty)
                table[key] = done[id(tensor)]


def preset_nbytes(name: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a preset's parameters in ``dtype``, counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name, layers), dtype=dtype)
    return sum(p.nbytes for p in model.parameters())
