"""Co-compute paradigm: routed experts run on the CPU, in place on host-resident weights.

Per MoE layer, forward: routed activations go device→host on a side stream, a worker thread computes the
experts with their LoRA on the CPU while the caller queues the shared experts on the device, then the output
goes host→device. Backward mirrors it synchronously. One ``torch.autograd.Function`` carries the gradients of
the hidden states, of the top-k routing weights (so the router, and every LoRA before it, gets the right
gradient) and of every expert LoRA factor, which live and are updated in host memory.

The autograd node is created when the work is submitted, at the point where the original model calls its
experts, so autograd sees the same graph, in the same order, as the unmodified model.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future

import torch
from torch.profiler import record_function

from ..config import MoeccConfig
from ..experts import ExpertBackend, ExpertLora, SavedState
from ..experts.select import cpu_backend
from ..lora import lora_tensors
from ..staging import HostCopy, StagingBuffers
from .base import (Engine, EngineDescription, ExpertLayer, FiniteFlags, Pending, Worker, node_gradients,
                   saved_state_gone)


class CoComputeEngine(Engine):
    """Shared state of every co-compute layer: staging buffers, the CPU backend, the worker, metrics."""

    name = "cocompute"

    def __init__(self, device: torch.device, backend: ExpertBackend) -> None:
        super().__init__(device)
        self.staging = StagingBuffers(device)
        self.backend = backend
        self._bytes_mark = (0, 0)
        # One worker: layers are sequential, and the kernels parallelise inside a call.
        self.worker = Worker("moecc-experts")

    @classmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> CoComputeEngine:
        return cls(device, cpu_backend(config.backend, config.isa, prepack=config.prepack_weights))

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        self.backend.prepare_layers([layer.weights for layer in self.layers])

    def describe(self) -> EngineDescription:
        return EngineDescription(cpu=self.backend)

    def release_result(self, host: torch.Tensor) -> None:
        """Hands a CPU expert output or input gradient back to the backend once it is on the device."""
        self.backend.release_result(host)

    def reset_metrics(self) -> None:
        self.metrics.reset()
        self._bytes_mark = (self.staging.bytes_to_device, self.staging.bytes_to_host)

    def counters_since_reset(self) -> dict[str, float]:
        """Totals since the last :meth:`reset_metrics`: seconds of CPU expert work, GB copied each way, seconds
        the device waited on the CPU (forward blocking plus the synchronous backward), tokens, routing skew."""
        m = self.metrics
        return {
            "cpu_experts_s": m.cpu_forward_s + m.cpu_backward_s,
            "h2d_gb": (self.staging.bytes_to_device - self._bytes_mark[0]) / 1e9,
            "d2h_gb": (self.staging.bytes_to_host - self._bytes_mark[1]) / 1e9,
            "gpu_wait_s": m.wait_s + m.cpu_backward_s,
            "tokens": float(m.tokens),
            "routing_skew": m.routing_skew,
        }


class ExpertJob:
    """One layer's forward on the CPU: its inputs, LoRA factors, and (once done) what backward needs."""

    def __init__(self, layer: CoComputeLayer, lora: tuple[ExpertLora | None, ExpertLora | None]) -> None:
        self.layer = layer
        self.weights = layer.weights
        self.lora = lora
        self.future: Future | None = None
        self.saved: SavedState | None = None
        self.shape: tuple | None = None  # (hidden shape, top_k shape) it was submitted with
        # A checkpointed layer's recomputation replays this job, copying its host output to the device again, until
        # its backward has run: its output goes back to the backend then, not once first copied.
        self.may_replay = False
        self.finite: FiniteFlags | None = None  # the inputs' flags, staged with them and verified before computing

    def compute(self, staged: HostCopy) -> torch.Tensor:
        engine = self.layer.engine
        views = staged.wait()
        finite, self.finite = self.finite, None  # its references to the device inputs go now
        if finite is not None:
            finite.verify(views["finite"].tolist())
        start = time.perf_counter()
        with record_function("moecc.cpu_experts.forward"):
            out, saved = engine.backend.forward(self.weights, views["hidden"], views["top_k_index"],
                                                views["top_k_weights"], *self.lora)
        engine.metrics.cpu_forward_s += time.perf_counter() - start
        engine.metrics.tokens_routed += views["top_k_index"].numel()
        engine.metrics.add_expert_counts((saved.offsets[1:] - saved.offsets[:-1]).tolist())
        self.saved = saved
        return out


class PendingExperts:
    """Handle returned by ``CoComputeLayer.submit``; ``result()`` waits for the CPU and returns the output."""

    def __init__(self, output: torch.Tensor, job: ExpertJob) -> None:
        self._output = output
        self._job = job

    def result(self) -> torch.Tensor:
        """The routed-expert output ``[T, H]`` on the device (the tensor autograd already knows)."""
        engine = self._job.layer.engine
        start = time.perf_counter()
        host = self._job.future.result()
        engine.metrics.wait_s += time.perf_counter() - start
        with torch.no_grad(), record_function("moecc.cpu_experts.to_device"):
            engine.staging.copy_to_device("out", host, self._output)
        if not self._job.may_replay:  # copied and never needed again: a later forward writes into these pages
            engine.release_result(host)
        return self._output


class CoComputeLayer(ExpertLayer):
    """One MoE layer's routed experts on the CPU, with the PEFT wrappers that hold their LoRA."""

    engine: CoComputeEngine

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: CoComputeEngine,
                 index: int = 0) -> None:
        super().__init__(name, experts, wrappers, engine, index)
        # Jobs whose backward is still to come, newest last. Under non-reentrant gradient checkpointing the
        # layer's forward runs again inside backward only to regenerate saved tensors; the original autograd
        # node (holding the first job) is the one differentiated, so that rerun takes the first job's result
        # instead of running the experts on the CPU a second time.
        # Weak references: a graph dropped without a backward frees its jobs as before.
        self.pending_backward: list[weakref.ref] = []

    def _job_to_replay(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> ExpertJob | None:
        """The newest job still waiting for its backward, if this call (a recomputation) repeats it."""
        self.pending_backward = [ref for ref in self.pending_backward
                                 if ref() is not None and (ref().saved is not None or not ref().future.done())]
        if not self.pending_backward:
            return None
        job = self.pending_backward[-1]()
        if job is None:
            return None
        job.future.result()  # long done: its layer's output was used before backward started
        return job if _replayable(job, hidden, top_k_index) else None

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        """Starts the routed experts on ``hidden [T, H]``; queue independent device work, then call ``result()``."""
        finite = self.check_inputs(hidden, top_k_index, top_k_weights)  # expert ids: by the CPU grouping
        recomputing = self.begin_call(hidden)
        if recomputing and torch.is_grad_enabled():
            earlier = self._job_to_replay(hidden, top_k_index)
            if earlier is not None:
                output = CpuExpertsFunction.apply(hidden, top_k_weights, earlier, *lora_tensors(earlier.lora))
                return self.checked(PendingExperts(output, earlier))
        staged = self.engine.staging.to_host({
            "hidden": hidden.detach().contiguous(),
            "top_k_index": top_k_index.contiguous(),
            "top_k_weights": top_k_weights.detach().contiguous(),
            **({} if finite is None else {"finite": finite.flags}),  # read by the worker, which waits for the copy
        })
        job = ExpertJob(self, self.lora())
        job.finite = finite
        job.shape = (tuple(hidden.shape), tuple(top_k_index.shape))
        job.future = self.engine.worker.submit(job.compute, staged)
        if torch.is_grad_enabled() and not recomputing:
            # Forwards whose graph was dropped without a backward leave dead references: drop them here.
            self.pending_backward = [ref for ref in self.pending_backward if ref() is not None]
            self.pending_backward.append(weakref.ref(job))
            job.may_replay = True
        output = CpuExpertsFunction.apply(hidden, top_k_weights, job, *lora_tensors(job.lora))
        return self.checked(PendingExperts(output, job))


def _replayable(job: ExpertJob, hidden: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    return job.saved is not None and job.shape == (tuple(hidden.shape), tuple(top_k_index.shape))


class CpuExpertsFunction(torch.autograd.Function):
    """Autograd node of one layer's CPU experts; LoRA A/B tensors are inputs so they receive gradients.

    ``forward`` only allocates the output: the CPU fills it in ``PendingExperts.result``, before any consumer.
    """

    @staticmethod
    def forward(ctx, hidden, top_k_weights, job, *lora_tensors):
        ctx.job = job
        ctx.hidden_dtype, ctx.weights_dtype = hidden.dtype, top_k_weights.dtype
        return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.job.layer.checked_backward(grad_out, lambda: CpuExpertsFunction._backward(ctx, grad_out))

    @staticmethod
    def _backward(ctx, grad_out):
        job = ctx.job
        if job.saved is None:
            raise saved_state_gone("CPU")
        engine = job.layer.engine
        views = engine.staging.to_host({"grad_out": grad_out.contiguous()}).wait()
        start = time.perf_counter()
        with record_function("moecc.cpu_experts.backward"):
            grad_hidden, grad_weights, lora_grads = engine.backend.backward(job.weights, job.saved,
                                                                            views["grad_out"], *job.lora)
        engine.metrics.cpu_backward_s += time.perf_counter() - start
        job.saved = None  # release host activations as soon as they are used (and the job can no longer replay)
        if job.may_replay:
            engine.release_result(job.future.result())
        job.layer.pending_backward = [ref for ref in job.layer.pending_backward if ref() not in (job, None)]
        staging = engine.staging
        host_grad_hidden = grad_hidden
        grad_hidden = staging.to_device("grad_hidden", host_grad_hidden.to(ctx.hidden_dtype))
        engine.release_result(host_grad_hidden)  # copied: the next layer's backward writes into these pages
        grad_weights = staging.to_device("grad_weights", grad_weights.to(ctx.weights_dtype))
        return node_gradients(ctx, grad_hidden, grad_weights, job.lora, lora_grads)


CoComputeEngine.layer_class = CoComputeLayer
