"""Engine options, and the one place ``MOECC_*`` environment variables are read."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import MoeccError

BACKENDS = ("auto", "reference", "native")
OFFLOAD_COMPUTES = ("auto", "grouped", "reference")
ISAS = ("auto", "amx", "avx512_bf16", "portable")
OFFLOAD_LORA = ("auto", "device", "host")
EXPERT_FORMATS = ("auto", "bf16", "fp8", "int8", "int4", "mxfp4")
QUANTIZED_FORMATS = ("fp8", "int8", "int4", "mxfp4")
INT4_GROUP_SIZES = (32, 64, 128)
# The default int4 group (inputs sharing one scale) follows accuracy measured against the bf16 model over 32 / 64 /
# 128; each group costs 4 bytes of scale, so a smaller one must buy its memory in accuracy.
DEFAULT_INT4_GROUP = 128
# Range limits of the options: past them a value is a typo, not a machine (the largest hosts have under 1,000 CPUs;
# a slot holds one layer of experts, and models have under 200 layers)
MAX_THREADS = 4096
MAX_SLOTS = 1024
MAX_GB = 100_000.0


@dataclass
class MoeccConfig:
    """Options of the CPU expert engine that are not part of the LoRA configuration.

    Attributes:
        num_threads: CPU threads for expert work, the calling thread included; ``None`` uses every CPU this
            process may run on. Environment: ``MOECC_NUM_THREADS``.
        backend: CPU expert math implementation. ``"native"``: the C++ kernels on packed bf16 weights (bf16
            models in the standard expert layout; agrees with the reference to bf16 tolerance, not bit for
            bit, because LoRA is applied factorised instead of folded into the weight). ``"reference"``: the
            plain-PyTorch oracle, which matches HF + PEFT bit for bit and runs every dtype and layout.
            ``"auto"`` (default): native for the layers it runs, reference for the rest (float32/float16
            models, gpt-oss-style experts). Environment: ``MOECC_BACKEND``.
        isa: instruction set of the native kernels: ``"auto"`` (the best this CPU runs), ``"amx"``,
            ``"avx512_bf16"`` or ``"portable"``. Environment: ``MOECC_ISA``.
        pin_threads: pin pool threads to cores. Environment: ``MOECC_PIN_THREADS`` (0/1).
        gpu_memory_budget_gb: cap on this process's GPU memory (enforced with the allocator's per-process
            fraction); ``prepare`` fails up front, saying how much is needed, when the resident parts do not
            fit. None: no cap. Environment: ``MOECC_GPU_BUDGET_GB``.
        offload_cache_gb: device memory for offload's (and hybrid's) cache of the most frequently routed experts,
            served to the slots without crossing PCIe again (0: no cache). Counted in the GPU budget. ``"auto"``:
            whatever the GPU budget (without one, the device's free memory) leaves at each batch size, less a 12%
            margin, from the peak measured for that size; a pass runs without a cache until one of at least its
            tokens was measured with its backward (an evaluation: its forward). Under ``"auto"`` the engine resets
            the allocator's peak statistics at each forward pass, so ``torch.cuda.max_memory_allocated`` covers
            the pass since. Environment: ``MOECC_OFFLOAD_CACHE_GB``.
        offload_slots: layers of experts the offload and hybrid paradigms keep on the device at once (2 = the
            current layer plus the one being prefetched). Hybrid copies ``offload_slots - 1`` layers ahead in
            both passes, so its copies go on while a layer's CPU part outlasts the next layer's copies (each slot
            costs one layer of experts in the GPU budget). Environment: ``MOECC_OFFLOAD_SLOTS``.
        offload_compute: device-side expert math of the offload paradigm. ``"grouped"``: one grouped matrix
            product per projection, LoRA factorised (agrees with HF + PEFT to the dtype's rounding).
            ``"reference"``: one expert at a time with PEFT's folded ``W + ΔW``, bit-exact with HF + PEFT.
            ``"auto"`` (default): grouped on CUDA, reference elsewhere. Environment: ``MOECC_OFFLOAD_COMPUTE``.
        prepack_weights: co-compute with the native kernels keeps a second copy of each layer's expert weights in
            the kernels' panel layout, made in ``prepare``, which the forward products read instead of packing
            each task's slice as they go. Doubles the experts' host memory (``prepare`` checks it is there);
            off by default. Environment: ``MOECC_PREPACK_WEIGHTS`` (0/1).
        offload_lora: where the offload paradigm keeps the expert LoRA factors (float32 masters, their gradients
            and the optimizer's state). ``"device"``: on the GPU, used in place (no copies, and the optimizer
            steps them there). ``"host"``: in pinned host memory, copied to the device once per forward pass and
            their gradients copied back; the optimizer steps them on the CPU, where nothing hides its time (use
            a fused AdamW). ``"auto"`` (default): the device when factors, gradients and two AdamW moments take
            at most a quarter of the GPU budget (of the GPU's memory without a budget), else the host.
            Environment: ``MOECC_OFFLOAD_LORA``.
        check_finite: ``True`` (default): every MoE layer's inputs (hidden states and routing weights) and the
            loss are checked for NaN / inf, and a non-finite one raises an error naming the layer, the tensor and
            the step (forward pass) before the layer computes anything. The layers' flags are reduced where the
            tensors are and read where the engine reads the routing anyway (no extra host sync); the loss costs one
            read of a scalar per forward pass.
            ``"all"``: also each layer's output and gradients (incoming, and those it computes), a host sync per
            tensor; ``MoeccCallback`` turns this on at logging steps. ``False``: no checks. Environment:
            ``MOECC_CHECK_FINITE`` (0/1 or all).
        split_policy: how the hybrid paradigm divides each layer's routed experts between the GPU and the CPU:
            ``"planned"`` (default: balances CPU seconds against copy and GPU seconds from costs measured while both
            sides run, and on a CUDA GPU falls back to whole steps with every expert on the GPU where those are
            faster), or ``"coldest:SHARE"`` (the least-routed experts on the CPU up to ``SHARE`` of the routed
            experts' bytes, a baseline with no cost model). A ``moecc.paradigms.split_policy.SplitPolicy`` object
            is used as it is (tests, A/B runs). Environment: ``MOECC_SPLIT_POLICY``.
        expert_format: how host memory holds the routed experts' frozen weights (attention, dense layers, shared
            experts and every LoRA factor keep their dtype). ``"auto"`` (default): as the model or checkpoint holds
            them (bf16 stays bf16; an FP8 checkpoint stays FP8 and an MXFP4 one MXFP4). ``"bf16"``: unquantized
            bfloat16 (a quantized checkpoint is dequantized while loading). ``"fp8"`` (e4m3, one scale per
            128 x 128 block: ~1 byte a weight), ``"int8"`` (one scale per output row: ~1 byte), ``"int4"`` (one
            scale per ``int4_group_size`` inputs: ~0.5 byte) and ``"mxfp4"`` (e2m1, a power-of-two scale per 32:
            ~0.53 byte): one quantized copy, made layer by layer in ``prepare`` (or while ``from_pretrained``
            loads), the bf16 parameters left as shape-only placeholders; the LoRA trains on top of the weights'
            quantized values. Quantized experts need a bfloat16 model and the co-compute paradigm, and PEFT cannot
            merge adapters into them. Environment: ``MOECC_EXPERT_FORMAT``.
        int4_group_size: inputs sharing one scale under ``expert_format="int4"``: 32, 64 or 128 (default), which
            must divide both the hidden and the expert intermediate size. Environment: ``MOECC_INT4_GROUP``.
    """

    num_threads: int | None = None
    backend: str = "auto"
    pin_threads: bool = True
    isa: str = "auto"
    gpu_memory_budget_gb: float | None = None
    offload_slots: int = 2
    offload_cache_gb: float | str = 0.0
    offload_lora: str = "auto"
    offload_compute: str = "auto"
    prepack_weights: bool = False
    check_finite: bool | str = True
    split_policy: object = "planned"
    expert_format: str = "auto"
    int4_group_size: int = DEFAULT_INT4_GROUP

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises MoeccError naming the first field whose value has the wrong type or lies out of range, with
        the value seen and what it may be (``prepare`` calls it again, for fields set after construction)."""
        check_choice("moecc backend", self.backend, BACKENDS)
        check_choice("ISA", self.isa, ISAS)
        check_choice("offload_lora", self.offload_lora, OFFLOAD_LORA)
        check_choice("offload_compute", self.offload_compute, OFFLOAD_COMPUTES,
                     " ('grouped': grouped products, LoRA factorised; 'reference': bit-exact with HF + PEFT)")
        if self.num_threads is not None:
            check_whole("num_threads", self.num_threads, 1, MAX_THREADS, "or None (every CPU)")
        check_whole("offload_slots", self.offload_slots, 1, MAX_SLOTS)
        check_flag("pin_threads", self.pin_threads)
        check_flag("prepack_weights", self.prepack_weights)
        if self.check_finite != "all":
            check_flag("check_finite", self.check_finite, " or 'all' (outputs and gradients too)")
        if self.gpu_memory_budget_gb is not None:
            check_gb("gpu_memory_budget_gb", self.gpu_memory_budget_gb, positive=True)
        if isinstance(self.offload_cache_gb, str) and self.offload_cache_gb.strip().lower() == "auto":
            self.offload_cache_gb = "auto"
        else:
            if isinstance(self.offload_cache_gb, str):  # text that is not "auto"
                raise MoeccError(f"offload_cache_gb must be a number of GB or 'auto', got {self.offload_cache_gb!r}; "
                                 "use a number of GB (0 = no cache) or 'auto'")
            check_gb("offload_cache_gb", self.offload_cache_gb, positive=False, words="or 'auto' (0 = no cache)")
        self._check_split_policy()
        self._check_expert_format()

    def _check_split_policy(self) -> None:
        from .paradigms.split_policies import split_policy  # the paradigms import this module

        split_policy(self.split_policy)

    def _check_expert_format(self) -> None:
        if not isinstance(self.expert_format, str) or self.expert_format.strip().lower() not in EXPERT_FORMATS:
            raise MoeccError(f"unknown expert_format {self.expert_format!r}; choose one of "
                             f"{', '.join(EXPERT_FORMATS)} ('auto' keeps the model's or checkpoint's own format)")
        self.expert_format = self.expert_format.strip().lower()
        group = self.int4_group_size
        if isinstance(group, bool) or group not in INT4_GROUP_SIZES:
            raise MoeccError(f"int4_group_size={group!r} is not supported; choose one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))} (inputs sharing one scale)")

    @classmethod
    def from_env(cls) -> MoeccConfig:
        """Defaults, overridden by the ``MOECC_*`` variables named in the attributes above."""
        kwargs: dict = {}
        for variable, field_name, unit, most in (("MOECC_NUM_THREADS", "num_threads", "threads", MAX_THREADS),
                                                 ("MOECC_OFFLOAD_SLOTS", "offload_slots", "layers", MAX_SLOTS),
                                                 ("MOECC_INT4_GROUP", "int4_group_size", "inputs", None)):
            value = os.environ.get(variable, "").strip()
            if value:
                if not value.isdigit() or (most and not 1 <= int(value) <= most):
                    raise MoeccError(f"{variable}={os.environ[variable]!r} is not a whole number of {unit}"
                                     + (f" from 1 to {most}" if most else ""))
                kwargs[field_name] = int(value)
        if os.environ.get("MOECC_BACKEND"):
            kwargs["backend"] = os.environ["MOECC_BACKEND"]
        if os.environ.get("MOECC_ISA"):
            kwargs["isa"] = os.environ["MOECC_ISA"]
        if os.environ.get("MOECC_SPLIT_POLICY", "").strip():
            kwargs["split_policy"] = os.environ["MOECC_SPLIT_POLICY"].strip().lower()
        for variable, field_name in (("MOECC_OFFLOAD_LORA", "offload_lora"),
                                     ("MOECC_OFFLOAD_COMPUTE", "offload_compute"),
                                     ("MOECC_EXPERT_FORMAT", "expert_format")):
            if os.environ.get(variable, "").strip():
                kwargs[field_name] = os.environ[variable].strip().lower()
        for variable, field_name in (("MOECC_OFFLOAD_CACHE_GB", "offload_cache_gb"),
                                     ("MOECC_GPU_BUDGET_GB", "gpu_memory_budget_gb")):
            value = os.environ.get(variable)
            if value and field_name == "offload_cache_gb" and value.strip().lower() == "auto":
                kwargs[field_name] = "auto"
            elif value:
                try:
                    kwargs[field_name] = float(value)
                except ValueError:
                    raise MoeccError(f"{variable}={value!r} is not a number of GB"
                                     + (" or 'auto'" if field_name == "offload_cache_gb" else "")) from None
                check_gb(f"{variable} ({field_name})", kwargs[field_name], positive=field_name != "offload_cache_gb")
        for variable, field_name in (("MOECC_PIN_THREADS", "pin_threads"),
                                     ("MOECC_PREPACK_WEIGHTS", "prepack_weights")):
            value = env_flag(variable)
            if value is not None:
                kwargs[field_name] = value
        if os.environ.get("MOECC_CHECK_FINITE", "").strip().lower() == "all":
            kwargs["check_finite"] = "all"
        elif env_flag("MOECC_CHECK_FINITE", "; or all (outputs and gradients too)") is not None:
            kwargs["check_finite"] = env_flag("MOECC_CHECK_FINITE")
        return cls(**kwargs)


FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def env_flag(variable: str, more: str = "") -> bool | None:
    """The value of an on/off ``MOECC_*`` variable (1/true/yes or 0/false/no, any case); None when unset or empty.
    ``more``: other accepted words, for the error message."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return None
    if value.lower() not in FLAGS:
        raise MoeccError(f"{variable}={os.environ[variable]!r}: use 1/true/yes or 0/false/no{more}")
    return FLAGS[value.lower()]


def check_choice(name: str, value, choices: tuple[str, ...], meaning: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        raise MoeccError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}{meaning}")


def check_whole(name: str, value, least: int, most: int, words: str = "") -> None:
    """Refuses anything but a whole number (an ``int``, not a bool, float or string) in ``[least, most]``."""
    wanted = f"a whole number (an int) from {least} to {most}{' ' + words if words else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        as_text = str(value).strip()
        fix = (f"; write {name.split()[0]}={int(float(as_text))}" if as_text.replace(".", "", 1).isdigit()
               and float(as_text).is_integer() else "")
        raise MoeccError(f"{name} must be {wanted}, got {value!r} of type {type(value).__name__}{fix}")
    if not least <= value <= most:
        raise MoeccError(f"{name} must be {wanted}, got {value}")


def check_flag(name: str, value, words: str = "") -> None:
    """Refuses anything but True / False: a string such as "false" would read as on."""
    if not isinstance(value, bool):
        raise MoeccError(f"{name} must be True or False{words}, got {value!r} of type {type(value).__name__}")


def check_gb(name: str, value, positive: bool, words: str = "") -> None:
    """Refuses anything but a finite number of GB, above 0 (``positive``) or at least 0, and at most ``MAX_GB``."""
    bound = "a positive number of GB (greater than 0)" if positive else "a number of GB >= 0"
    wanted = f"{bound} and at most {MAX_GB:g}{' ' + words if words else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MoeccError(f"{name} must be {wanted}, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value):
        raise MoeccError(f"{name} must be {wanted}, got {value} (not finite)")
    if value < 0 or (positive and value == 0) or value > MAX_GB:
        raise MoeccError(f"{name} must be {wanted}, got {value:g}")


def native_bf16_from_env() -> bool:
    """Whether the native kernels may round to bf16 with AVX512-BF16's instruction where the CPU has it (it
    flushes float32 denormals to zero; off runs the integer rounding every other CPU runs). A process-wide setting
    the kernels read once, so ``moecc._ops`` applies it at import. Environment: ``MOECC_NATIVE_BF16`` (default on)."""
    allowed = env_flag("MOECC_NATIVE_BF16")
    return True if allowed is None else allowed
