"""ModelRunner: the one place where Python lists become tensors.

Owns: the KV cache tensors (per layer, K and V of shape (NB, BS, Hkv, D) in
the compute dtype, or float8 e4m3 with `--kv-cache-dtype fp8`), turning a step's plan (`SchedulerOutput`) into a
`ForwardBatch`, running the model (or replaying a decode CUDA graph that
copies from the same host arrays), sampling on the device, and handing back
plain host lists (`RunnerOutput`): one device-to-host copy per step. Also owns
each seeded request's random generator, for the request's life. Does not own:
which requests run (scheduler), which pages they hold (block manager), text.

Token i of a request lives at slot `block_table[i // BS] * BS + i % BS`.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm import memory
from pagedllm.cpu_threads import threads_for_step
from pagedllm.engine_config import EngineConfig
from pagedllm.model import load_model
from pagedllm.model.batch import ForwardBatch
from pagedllm.model.linear import numpy_projections
from pagedllm.model.llama import KVCache, LlamaModel
from pagedllm.model.loader import model_quantization, resolve_device, resolve_dtype
from pagedllm.model.parallel import TensorParallel
from pagedllm.ops import implementation_name
from pagedllm.ops.reference import FP8_KV_DTYPE
from pagedllm.request import Request
from pagedllm.resolve import resolve_model_path
from pagedllm.runner.batch import HostBatch
from pagedllm.runner.cuda_graphs import CopyFence, DecodeGraphs, PrefillGraphs
from pagedllm.sampling import Sampler, SamplingMetadata, compute_logprobs, make_generator
from pagedllm.scheduler import SchedulerOutput
from pagedllm.utils import deferred_interrupts

MiB = 1 << 20
Logprobs = dict[int, float]  # token id -> log-prob: the chosen token and the top k


class RankWorkers(Protocol):
    """What the runner needs of a tensor-parallel engine's other ranks: the step's
    batch sent to them, the group's collectives, and word of a failed step.

    `runner/tp_workers.py`'s `TPWorkers` is one. Named here, not imported from
    there: the workers build a `ModelRunner` of their own, so the runner must
    not import them back (an import circle)."""

    tp: TensorParallel

    def send(self, message: tuple[str, Any]) -> None: ...

    def step_failed(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # K + V across all layers
    dtype: torch.dtype  # of the K/V pages: the model's, or float8 e4m3

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def mib(self) -> float:
        return self.num_blocks * self.block_size * self.bytes_per_token / MiB


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: what `collect` needs to finish it."""

    plan: SchedulerOutput
    done: list[int]  # rows of the plan that sample a token
    sampled: torch.Tensor | None = None  # (len(done),) ids, on the device
    logprobs: object | None = None  # the sampler's log-probs (device tensors), if asked
    logprobs_ks: list[int | None] = field(default_factory=list)
    prompt_logprobs: dict = field(default_factory=dict)
    host_ids: torch.Tensor | None = None  # pinned copy of `sampled`, filled asynchronously
    copied: torch.cuda.Event | None = None  # recorded after that copy
    # Constrained decoding: (logits, constrained rows, sampling metadata, requests)
    # whose masking and sampling wait for the masks; or (the sampler's scores, rows,
    # None, requests) where sampling is token by token (`SamplingMetadata.tokenwise`:
    # the noise is drawn at launch, only the mask and an argmax wait). Under async
    # scheduling a continuation keeps it until its matchers have consumed the tokens
    # of the step before (`ModelRunner.sample_deferred`).
    deferred: tuple | None = None
    # Each seeded request's generator state before this step drew from it
    # (`ModelRunner.restore_generators`: a step that is undone gives its draws back).
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    """What one step computed, as host values, parallel to the plan's requests."""

    # The sampled id of each request that computed its last token this step;
    # None for one still computing its prompt (a chunk that ends short of it).
    sampled_token_ids: list[int | None]
    # For requests that asked for log-probs and were sampled: the sampled
    # token's log-prob and the top `logprobs` ones.
    logprobs: list[Logprobs | None]
    # request_id -> (k, entries): prompt log-probs of prompt tokens k, k+1, ...,
    # from the positions computed this step (vLLM's format: None for prompt
    # token 0, then {id: logprob} with the prompt's own token and the top
    # `prompt_logprobs`).
    prompt_logprobs: dict[int, tuple[int, list[Logprobs | None]]] = field(default_factory=dict)


def load_or_check_model(
    config: EngineConfig,
    model: LlamaModel | None,
    max_positions: int,
    tp: TensorParallel | None = None,
) -> LlamaModel:
    """The engine's model: `model` as given (checked against the config), or
    loaded from `config.model` (the default model when None) for at most
    `max_positions` positions; with `tp`, rank 0's slice of it."""
    if model is None:
        # Before the weights, not only before the cache is planned: weights loaded
        # while a dropped engine's blocks sit in PyTorch's cache are placed inside
        # them, and what is left of those blocks can be neither used nor handed
        # back. On the H200 a second 1B engine then got 2.3 % fewer K/V pages than
        # the first (228,540 against 234,021; docs/benchmarks.md, twelfth increment).
        release_device_cache(resolve_device(config.device))
        return load_model(
            resolve_model_path(config.model),
            config.device,
            config.dtype,
            max_model_len=max_positions,
            tp=tp,
            load_format=config.load_format,
            quantization=config.quantization,
        )
    if config.quantization == "fp8" and model_quantization(model) != "fp8":
        # A model loaded without FP8 weights would run in its own dtype under an fp8 label.
        raise ValueError(
            "quantization='fp8' but the model given was loaded without FP8 weights; load "
            "it with quantization='fp8', or leave quantization unset"
        )
    if config.device is not None:
        # An already loaded model is used as it is: a device or dtype that says
        # otherwise is a mistake, not a request to convert.
        want = resolve_device(config.device)
        have = model.device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(
                f"device={str(config.device)!r} but the model given is on {have}; "
                f"load it on that device, or leave device unset"
            )
    if config.dtype is not None:
        want_dtype = resolve_dtype(config.dtype, model.device)
        if want_dtype != model.dtype:
            raise ValueError(
                f"dtype={str(config.dtype)!r} but the model given is {model.dtype}; "
                f"load it in that dtype, or leave dtype unset"
            )
    return model


def kv_cache_dtype(setting: str, model: LlamaModel) -> torch.dtype:
    """The dtype of the K/V pages for `EngineConfig.kv_cache_dtype`: "auto" is the
    model's; "fp8" is float8 e4m3, which the GPU kernels convert in hardware from
    compute capability 8.9 (Ada, Hopper) on."""
    if setting == "auto":
        return model.dtype
    if setting != "fp8":
        raise ValueError(f"kv_cache_dtype={setting!r} is not one of auto, fp8")
    if model.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(model.device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer "
                f"(this one is {major}.{minor}); use --kv-cache-dtype auto"
            )
    return FP8_KV_DTYPE


def release_device_cache(device: torch.device) -> None:
    """Give dropped engines' memory back to a CUDA device; nothing on the CPU.

    An engine dropped by its user (`del llm`) may not be freed yet: the first
    engine of a process is held in a reference cycle (while torch is imported,
    `torch.fx.wrap` keeps its own frame in a cycle, and with it every caller's
    frame, `LLM.__init__`'s among them, until a full collection). So the
    collector runs first. Even once freed, the engine's blocks stay in PyTorch's
    allocator cache, and `empty_cache` hands back the ones nothing uses.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def free_device_bytes(device: torch.device) -> int:
    """Free memory on a CUDA device, in bytes, after `release_device_cache`; 0 on
    the CPU (its pool has a fixed size). A dropped engine's model and K/V pages
    would otherwise still take the memory measured here, and the new engine
    would plan a cache around them."""
    if device.type != "cuda":
        return 0
    release_device_cache(device)
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def plan_kv_cache(
    model: LlamaModel,
    block_size: int,
    kv_cache_mib: float | None,
    max_model_len: int,
    max_num_seqs: int,
    dtype: torch.dtype | None = None,
    free_bytes: int | None = None,
    ranks: int = 1,
) -> tuple[KVCacheSpec, str]:
    """How many pages to allocate, and a sentence saying why.

    `kv_cache_mib` counts K+V across all layers. Without it: on CUDA, 85% of
    the free device memory (vLLM's default leaves 10%); on the CPU, 256 MiB.
    Never more than max_num_seqs full-length sequences could use. `dtype`: of
    the pages (`kv_cache_dtype`); None: the model's. `free_bytes`: the free
    memory to plan for, given by a tensor-parallel engine (the least of its
    `ranks` ranks' free memory, so every rank can hold the same pool); None:
    this device's. The planned pages are checked against the memory available
    before anything is allocated (`check_kv_cache_fits`).
    """
    dtype = dtype or model.dtype
    itemsize = dtype.itemsize
    per_token = model.config.kv_bytes_per_token(itemsize)
    per_block = per_token * block_size
    if kv_cache_mib is not None:
        if kv_cache_mib <= 0:
            raise ValueError(f"kv_cache_mib must be positive, got {kv_cache_mib}")
        budget = int(kv_cache_mib * MiB)
        why = f"--kv-cache-mib {kv_cache_mib:.10g}"
    elif model.device.type == "cuda":
        free = free_device_bytes(model.device) if free_bytes is None else free_bytes
        budget = int(free * 0.85) - 2 * 1024 * MiB  # leave room for activations and graphs
        where = "free GPU memory" if ranks == 1 else f"the least free GPU memory of {ranks} ranks"
        why = f"85% of {where} ({free / 2**30:.1f} GiB free) less 2 GiB for activations"
    else:
        budget = 256 * MiB
        why = "CPU default of 256 MiB (set --kv-cache-mib to change)"
    useful = math.ceil(max_model_len / block_size) * max_num_seqs
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / MiB:.1f} MiB) holds not one page of {block_size} tokens "
            f"({per_block / MiB:.3f} MiB); raise --kv-cache-mib"
        )
    check_kv_cache_fits(int(num_blocks) * per_block, model.device, why, free_bytes, ranks)
    return KVCacheSpec(int(num_blocks), block_size, per_token, dtype), why


def check_kv_cache_fits(
    planned: int, device: torch.device, why: str, free_bytes: int | None = None, ranks: int = 1
) -> None:
    """ValueError, before any page is allocated, when a KV cache of `planned` bytes (one
    rank's) would take more than `memory.USABLE_FRACTION` of the memory available:
    CUDA's free memory (`free_bytes` when the engine measured it over its ranks), or
    on the CPU MemAvailable (or the memory cgroup's room, where less), which all
    `ranks` processes share. `why`: what sized the cache (`plan_kv_cache`'s
    sentence). The message says what --kv-cache-mib fits."""
    if device.type == "cuda":
        available = free_device_bytes(device) if free_bytes is None else free_bytes
        where = "free GPU memory" if ranks == 1 else f"the least free GPU memory of {ranks} ranks"
        sharing = 1
    else:
        found = memory.available_bytes(device)
        if found is None:  # no way to tell on this system: the allocation will say
            return
        available, where = found
        sharing = ranks  # the ranks of a CPU engine are processes of this machine
    if planned * sharing <= memory.usable(available):
        return
    fits = memory.usable(available) / sharing / MiB
    fits = math.floor(fits) if fits >= 10 else math.floor(fits * 10) / 10
    each = (
        f"{memory.size_text(planned)} for each of {ranks} ranks, together " if sharing > 1 else ""
    )
    raise ValueError(
        f"the KV cache sized by {why} takes {each}"
        f"{memory.over_text(planned * sharing, available, where)}; set --kv-cache-mib "
        f"(kv_cache_mib) to {fits:g} or less"
    )


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_spec: KVCacheSpec,
        max_model_len: int,
        max_num_seqs: int,
        use_cuda_graphs: bool = True,
        ops_mode: str | None = None,
        max_num_batched_tokens: int = 8192,
        workers: RankWorkers | None = None,
    ) -> None:
        """`workers`: the other ranks of a tensor-parallel engine (this is rank 0):
        each step's batch goes to them before the forward pass."""
        self.model = model
        self.workers = workers
        model.ops_mode = ops_mode
        self.device = model.device
        if self.device.type == "cuda":
            # Triton launches and graph capture use the current device.
            torch.cuda.set_device(self.device)
        self.block_size = kv_spec.block_size
        self.kv_spec = kv_spec
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.vocab_size = model.config.vocab_size
        # The block table is wide enough for the longest allowed context.
        self.max_blocks_per_seq = math.ceil(max_model_len / kv_spec.block_size)
        cfg = model.config
        shape = (kv_spec.num_blocks, kv_spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches: list[KVCache] = [
            (
                torch.zeros(shape, dtype=kv_spec.dtype, device=self.device),
                torch.zeros(shape, dtype=kv_spec.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.pin = self.device.type == "cuda"
        # A host mirror of the block tables, one row per batch slot, rewritten
        # only when the request in that slot (or its page count) changes. Pinned
        # on CUDA, so the graphs copy changed rows from it asynchronously.
        tables = torch.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=torch.int32)
        self.host_tables_t = tables.pin_memory() if self.pin else tables
        self.host_tables = self.host_tables_t.numpy()
        # Who each row holds: (the block manager's list of that request's pages,
        # its length). The manager makes a new list whenever it admits a request,
        # so the same list object with the same length means the same pages.
        self._row_owner: list[tuple[list[int], int] | None] = [None] * max_num_seqs
        # Rows rewritten since the CUDA graphs' own copy of the table last saw them.
        self._dirty_rows: set[int] = set()
        self._rows = np.arange(max_num_seqs)
        self._arange32 = np.arange(max_num_seqs + 1, dtype=np.int32)
        self.sampler = Sampler(ops_mode)
        self._generators: dict[int, torch.Generator] = {}  # seeded requests only
        # Waited on before the host memory that copies read from is rewritten.
        self.fence = CopyFence(enabled=self.pin)
        self.graphs = None
        self.prefill_graphs = None
        # Graphs need the Triton kernels: their padding rows (slot -1) are no-ops
        # there, while the reference store would wrap -1 to the pool's last slot.
        if (
            use_cuda_graphs
            and self.device.type == "cuda"
            and implementation_name(self.device, ops_mode) == "triton"
        ):
            self.graphs = DecodeGraphs(
                model, self.kv_caches, max_num_seqs, max_model_len, self.host_tables_t, self.fence
            )
            self.prefill_graphs = PrefillGraphs(
                model,
                self.kv_caches,
                min(max_num_batched_tokens, max_model_len),
                max_model_len,
                self.host_tables_t,
                self.fence,
            )
        self._bitmask = None  # constrained decoding's (max_num_seqs, words) host buffer
        # Whether any running request has a constraint (set by the engine each step).
        self.masking = False
        self.host_time_s = 0.0  # time spent building batches and launching, on the host
        self.num_steps = 0

    # ------------------------------------------------------------------
    def prepare(self, plan: SchedulerOutput, all_logits_rows: frozenset[int]) -> HostBatch:
        """Flatten the plan's new tokens into host arrays (the one builder).

        Logits are wanted for each sequence's last new token, and for every new
        token of the sequences in `all_logits_rows` (prompt log-probs); in that
        case the rows of each sequence are contiguous and its last comes last.
        """
        reqs, counts, starts = plan.scheduled, plan.num_new_tokens, plan.num_computed_tokens
        num_seqs = len(reqs)
        decode = plan.num_prefill_tokens + plan.num_decode_tokens == num_seqs
        # One pass over the requests (at batch 256 each pass costs ~0.1 ms): refresh
        # the block-table rows whose request changed; on decode steps also pick
        # each request's one new token.
        row_owner, host_tables, dirty = self._row_owner, self.host_tables, self._dirty_rows
        ids: list[int] = []
        # A continuation's input tokens are not known yet: they are fed on the device.
        known = not plan.is_continuation
        longest = 0
        for i, (req, table, c) in enumerate(zip(reqs, plan.block_tables, starts)):
            n = len(table)
            old = row_owner[i]
            if old is None or old[0] is not table or old[1] != n:
                row_owner[i] = None  # a Ctrl-C in here leaves the row marked stale
                host_tables[i, :n] = table
                dirty.add(i)
                row_owner[i] = (table, n)
            if n > longest:
                longest = n
            if decode and known:
                prompt = req.prompt_token_ids
                ids.append(prompt[c] if c < len(prompt) else req.output_token_ids[c - len(prompt)])
        if decode:
            positions = np.array(starts, dtype=np.int64)
            input_ids = np.array(ids, dtype=np.int64) if known else np.zeros(num_seqs, np.int64)
            rows = self._rows[:num_seqs]
            cu_seqlens = self._arange32[: num_seqs + 1]
            seq_lens = (positions + 1).astype(np.int32)
            max_q_len = 1
            num_decode_seqs = 0
        elif num_seqs == 1:
            # One prompt alone (a long prompt's time to first token): the same
            # arrays in fewer NumPy calls. Inside the engine's step each call costs
            # several times what it does in a loop (cold caches): measured on a
            # development machine, this whole method 0.2 ms there against 0.05.
            c, n = starts[0], counts[0]
            positions = np.arange(c, c + n)
            input_ids = np.array(reqs[0].token_ids_between(c, c + n), dtype=np.int64)
            rows = 0  # every token's block-table row
            cu_seqlens = np.array((0, n), dtype=np.int32)
            seq_lens = np.array((c + n,), dtype=np.int32)
            max_q_len = n
            num_decode_seqs = 0  # n > 1: one new token would make this a decode step
        else:
            counts_np = np.array(counts, dtype=np.int64)
            positions = np.concatenate([np.arange(c, c + n) for c, n in zip(starts, counts)])
            input_ids = np.fromiter(
                chain.from_iterable(
                    r.token_ids_between(c, c + n) for r, c, n in zip(reqs, starts, counts)
                ),
                dtype=np.int64,
                count=len(positions),
            )
            rows = np.repeat(self._rows[:num_seqs], counts_np)
            cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int32)
            np.cumsum(counts_np, out=cu_seqlens[1:])
            seq_lens = np.add(starts, counts_np, dtype=np.int32)
            max_q_len = max(counts)
            # The scheduler puts decode tokens first: count the leading one-token rows.
            num_decode_seqs = next((i for i, n in enumerate(counts) if n != 1), num_seqs)
        bs = self.block_size
        # The slot of every new token: its page (from the block table) and offset.
        slot_mapping = host_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        # Width rounded up to a multiple of 16: Triton specializes integer arguments
        # (this row stride) on divisibility by 16, and a width that changes that
        # from step to step recompiles the prefill kernel (~0.5 s each time).
        width = min(-(-longest // 16) * 16, host_tables.shape[1])
        # Decode attention takes its rows longest context first (see ForwardBatch).
        decode_order = None
        if num_seqs > 1:
            d = num_seqs if decode else num_decode_seqs
            neg = -seq_lens
            decode_order = np.argsort(neg[:d], kind="stable").astype(np.int32)
            if d < num_seqs:
                rest = np.argsort(neg[d:], kind="stable").astype(np.int32) + d
                decode_order = np.concatenate((decode_order, rest))
        if all_logits_rows:
            logits_indices = _logits_indices(cu_seqlens, all_logits_rows)
        elif decode:
            logits_indices = rows  # row i's one token is token i
        else:
            logits_indices = cu_seqlens[1:].astype(np.int64) - 1
        return HostBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            cu_seqlens=cu_seqlens,
            logits_indices=logits_indices,
            block_tables=host_tables[:num_seqs, :width],
            longest_table=longest,
            max_q_len=max_q_len,
            max_seq_len=int(seq_lens.max()),
            num_decode_seqs=num_decode_seqs,
            decode_order=decode_order,
        )

    def _index(self, rows) -> torch.Tensor:
        """Row indices on the device without waiting for it: a copy from pageable
        memory would first wait for everything queued (the step in flight)."""
        return self._to_device(np.asarray(rows, dtype=np.int64), torch.long)

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def forward_batch(self, host: HostBatch) -> ForwardBatch:
        dev = self._to_device
        return ForwardBatch(
            input_ids=dev(host.input_ids, torch.long),
            positions=dev(host.positions, torch.long),
            slot_mapping=dev(host.slot_mapping, torch.long),
            block_tables=dev(host.block_tables, torch.int32),
            seq_lens=dev(host.seq_lens, torch.int32),
            cu_seqlens_q=dev(host.cu_seqlens, torch.int32),
            logits_indices=dev(host.logits_indices, torch.long),
            is_decode=host.is_decode,
            max_q_len=host.max_q_len,
            max_seq_len=host.max_seq_len,
            num_decode_seqs=host.num_decode_seqs,
            every_row=host.every_row,
            decode_order=None if host.decode_order is None else dev(host.decode_order, torch.int32),
        )

    # ------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step: build the batch, run the model, sample, copy to the host once."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, feed: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step's work on the device and return without waiting for it.

        `feed`: the step before, for a continuation plan (its input tokens are
        the ones `feed` samples, taken on the device: `plan.feed_rows`)."""
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        reqs = plan.scheduled
        if not reqs:
            return LaunchedStep(plan, [])
        if plan.is_continuation and (feed is None or feed.sampled is None):
            raise ValueError("a continuation plan needs the launched step before it")
        t0 = time.perf_counter()
        # Requests that want prompt log-probs get a logits row for every new
        # prompt token; everyone else only for their last new token.
        full = frozenset(
            i
            for i, (r, c) in enumerate(zip(reqs, plan.num_computed_tokens))
            if r.sampling_params.prompt_logprobs is not None and c < r.num_prompt_tokens
        )
        # The last step's copies may still be queued, reading the block-table
        # mirror (and staging) that prepare() rewrites: wait for them (only them).
        self.fence.wait()
        host = self.prepare(plan, full)
        fed = None
        if plan.is_continuation:
            fed = feed.sampled
            if len(plan.feed_rows) != len(fed) or plan.feed_rows != tuple(range(len(fed))):
                fed = fed[self._index(plan.feed_rows)]
        if host.is_decode and self.graphs is not None and self.graphs.can_run(host.num_seqs):
            logits = self.graphs.run(host, self._dirty_rows, fed)
        elif fed is None and self.prefill_graphs is not None and self.prefill_graphs.can_run(host):
            logits = self.prefill_graphs.run(host)
        else:
            batch = self.forward_batch(host)
            self.fence.copies_queued()
            if fed is not None:
                batch.input_ids = fed.to(torch.long).contiguous()
            if self.device.type == "cpu" and self.workers is None:
                # Decode's few rows multiply through numpy: its threads go to OpenBLAS.
                threads_for_step(
                    numpy_projections(batch.num_tokens, self.model.dtype) and not self.model.packed
                )
            logits = self._forward(host, batch, fed is not None)  # (rows, V), the model's dtype
        self.host_time_s += time.perf_counter() - t0
        self.num_steps += 1
        prompt_lp = self._prompt_logprobs(logits, plan, full) if full else {}
        # Sample for the requests that computed their last token.
        if plan.is_continuation:
            done = list(range(len(reqs)))  # every one: its input was its last token
        else:
            ends = host.seq_lens.tolist()
            done = [i for i, (r, end) in enumerate(zip(reqs, ends)) if end == r.num_tokens]
        step = LaunchedStep(plan, done, prompt_logprobs=prompt_lp)
        if not done:
            return step
        if full or len(done) < len(reqs):  # pick each sampled request's last row
            last_rows = _last_rows(host.cu_seqlens, full)
            logits = logits[self._index([last_rows[i] for i in done])]
        done_reqs = [reqs[i] for i in done] if len(done) < len(reqs) else list(reqs)
        constrained = None
        if self.masking:  # some request has a constraint (the engine says; else no scan)
            constrained = [(j, r.matcher) for j, r in enumerate(done_reqs) if r.matcher]
        generators = None
        if any(r.sampling_params.seed is not None for r in done_reqs):
            generators = [self._generator(r) for r in done_reqs]
        meta = SamplingMetadata.from_requests(done_reqs, self.vocab_size, self.device, generators)
        if not constrained:
            self._sample(step, logits, meta, done_reqs)
            return step
        continuation = plan.is_continuation  # read first: nothing may raise between draws and try
        try:
            if meta.tokenwise:
                # The noise and every sampling op but the last are queued now, behind
                # the forward pass; only the mask and one argmax wait for the fill.
                self._save_generators(step, done_reqs)
                step.deferred = (self.sampler.scores(logits, meta), constrained, None, done_reqs)
            else:
                step.deferred = (logits, constrained, meta, done_reqs)
            if continuation:
                # The matchers have not consumed the tokens `feed` samples (they are
                # not on the host yet): the engine advances them once they are, while
                # this forward pass runs, then calls sample_deferred.
                return step
            # The forward pass is queued: the masks are made while it runs.
            self._sample_masked(step)
        except BaseException:
            self.restore_generators(step)  # the engine never sees this step
            raise
        return step

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep) -> None:
        """Mask and sample a continuation launched with constrained rows (its
        `deferred`), once their matchers have consumed the tokens of the step
        before: fill the bitmask on the host while the step's forward pass runs
        on the device, then queue the masking, the sampling (or, where the
        noise was drawn at launch, one argmax) and the copy of the ids to the
        host (`collect` waits for them)."""
        if step.deferred is None:
            return
        self._sample_masked(step)

    def _sample_masked(self, step: LaunchedStep) -> None:
        tensor, constrained, meta, done_reqs = step.deferred
        step.deferred = None
        masked = self._mask(tensor, constrained)
        if meta is None:  # `tensor` holds the sampler's scores (launch): the noise is drawn
            step.sampled = self.sampler.pick(masked)
            step.logprobs_ks = [r.sampling_params.logprobs for r in done_reqs]
            self._copy_ids(step)
        else:
            self._sample(step, masked, meta, done_reqs)

    def _save_generators(self, step: LaunchedStep, done_reqs: list) -> None:
        """Each seeded request's generator state before this step draws from it."""
        for r in done_reqs:
            gen = self._generators.get(r.request_id)
            if gen is not None:  # host-side state (seed and offset): no device wait
                step.generator_states[r.request_id] = gen.get_state()

    def _sample(
        self, step: LaunchedStep, logits: torch.Tensor, meta: SamplingMetadata, done_reqs: list
    ) -> None:
        """Queue the sampling of `step`'s rows and the copy of the ids to the host."""
        self._save_generators(step, done_reqs)
        try:
            out = self.sampler(logits, meta)
            step.sampled = out.sampled_token_ids
            step.logprobs = out.logprobs
            step.logprobs_ks = [r.sampling_params.logprobs for r in done_reqs]
            self._copy_ids(step)
        except BaseException:
            # The engine never sees this step (launch raises before returning it):
            # give the draws back here.
            self.restore_generators(step)
            raise

    def _copy_ids(self, step: LaunchedStep) -> None:
        """Start the one device-to-host copy of the sampled ids; collect() waits for it."""
        if self.pin:
            step.host_ids = torch.empty(len(step.done), dtype=step.sampled.dtype, pin_memory=True)
            step.host_ids.copy_(step.sampled, non_blocking=True)
            step.copied = torch.cuda.Event()
            step.copied.record()

    def _mask(self, logits: torch.Tensor, constrained: list[tuple[int, Any]]) -> torch.Tensor:
        """Constrained decoding (structured/): each constrained row's logits of the
        tokens its matcher forbids become -inf, in place. The bitmask is filled on
        the host (llguidance's threads, the GIL released) after the forward pass was
        queued, so on a GPU the filling overlaps it; then one pinned copy and one
        kernel (a few element-wise ops without Triton). Unconstrained rows are not
        touched. When every row is constrained, bitmask row i is logits row i (no
        gather or scatter)."""
        from pagedllm.structured import fill_bitmask
        from pagedllm.structured.bitmask import allocate_bitmask, apply_bitmask

        words = constrained[0][1].adapter.words
        if self._bitmask is None or self._bitmask.shape[1] != words:
            self._bitmask = allocate_bitmask(self.max_num_seqs, words * 32, pin=self.pin)
        fill_bitmask(self._bitmask, [(k, m) for k, (_, m) in enumerate(constrained)])
        # `constrained` lists rows in order: as many as the logits means all of them.
        every = len(constrained) == logits.shape[0]
        rows = None if every else self._index([j for j, _ in constrained])
        return apply_bitmask(logits, self._bitmask, rows)

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's sampled ids; the step's results as host values."""
        if step.deferred is not None:
            raise RuntimeError("a step with constrained rows is collected before sample_deferred")
        reqs = step.plan.scheduled
        sampled: list[int | None] = [None] * len(reqs)
        logprobs: list[Logprobs | None] = [None] * len(reqs)
        if step.sampled is not None:
            if step.copied is not None:
                step.copied.synchronize()
                ids = step.host_ids.tolist()
            else:
                ids = step.sampled.tolist()
            entries = (
                _entries(step.logprobs, step.logprobs_ks) if step.logprobs is not None else None
            )
            for j, i in enumerate(step.done):
                sampled[i] = ids[j]
                if entries is not None:
                    logprobs[i] = entries[j]
        return RunnerOutput(sampled, logprobs, step.prompt_logprobs)

    def _forward(self, host: HostBatch, batch: ForwardBatch, fed: bool = False) -> torch.Tensor:
        """The model's logits for `batch`; with tensor-parallel workers, every rank
        runs it at once (they meet in its collectives). `fed`: the batch's input
        ids were sampled on this device by the step before (async scheduling) and
        are not in `host`: they go to the workers by a broadcast from rank 0."""
        if self.workers is None:
            return self.model.compute_logits(self.model.forward(batch, self.kv_caches))
        # Once the workers have the batch, rank 0 must reach the end of the forward
        # pass too: a Ctrl-C waits for it, and any other failure leaves the ranks
        # out of step for good (the workers wait in a collective rank 0 left).
        with deferred_interrupts():
            self.workers.send(("step_fed" if fed else "step", host))
            try:
                if fed:
                    self.workers.tp.broadcast(batch.input_ids)
                return self.model.compute_logits(self.model.forward(batch, self.kv_caches))
            except BaseException as e:
                self.workers.step_failed(e)  # a dead worker is reported; else: broken
                raise

    def restore_generators(self, step: LaunchedStep) -> None:
        """Put each seeded request's generator back where it was before `step`
        sampled: the engine undoes a failed step, plans its tokens again, and the
        draws must be those of a run that never failed."""
        for request_id, state in step.generator_states.items():
            gen = self._generators.get(request_id)
            if gen is not None:
                gen.set_state(state)

    def _generator(self, req: Request) -> torch.Generator | None:
        """A seeded request's own generator, made at its first sample and kept until it finishes."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = make_generator(seed, self.device)
        return gen

    def _prompt_logprobs(
        self, logits: torch.Tensor, plan: SchedulerOutput, full: frozenset[int]
    ) -> dict[int, tuple[int, list[Logprobs | None]]]:
        """Prompt log-probs of the prompt positions each `full` request computed:
        position p's logits give the log-prob of prompt token p + 1."""
        result: dict[int, tuple[int, list[Logprobs | None]]] = {}
        row = 0
        for i, (req, c, n) in enumerate(
            zip(plan.scheduled, plan.num_computed_tokens, plan.num_new_tokens)
        ):
            if i not in full:
                row += 1
                continue
            k = req.sampling_params.prompt_logprobs
            prompt = req.prompt_token_ids
            entries: list[Logprobs | None] = [None] if c == 0 else []
            end = min(c + n, len(prompt) - 1)  # the last prompt position predicts no prompt token
            if end > c:
                target = torch.tensor(prompt[c + 1 : end + 1], device=logits.device)
                lp = compute_logprobs(logits[row : row + end - c], k, target)
                entries += _entries(lp, [k] * (end - c))
            result[req.request_id] = (0 if c == 0 else c + 1, entries)
            row += n
        return result


def _entries(lp, ks: list[int | None]) -> list[Logprobs | None]:
    """Row j as {id: logprob}: its top ks[j] and its own token (always there);
    None where ks[j] is None (the request asked for none)."""
    ids, tok = lp.token_ids.tolist(), lp.token_logprobs.tolist()
    top_ids, top_lp = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
    out: list[Logprobs | None] = []
    for j, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[j][:k], top_lp[j][:k]))
        entry[ids[j]] = tok[j]
        out.append(entry)
    return out


def _logits_indices(cu_seqlens: np.ndarray, all_rows: frozenset[int]) -> np.ndarray:
    last = cu_seqlens[1:].astype(np.int64) - 1
    if not all_rows:
        return last
    parts = [
        np.arange(cu_seqlens[i], cu_seqlens[i + 1]) if i in all_rows else last[i : i + 1]
        for i in range(len(last))
    ]
    return np.concatenate(parts).astype(np.int64)


def _last_rows(cu_seqlens: np.ndarray, all_rows: frozenset[int]) -> list[int]:
    """Which logits row holds each sequence's last token."""
    if not all_rows:
        return list(range(len(cu_seqlens) - 1))
    rows, r = [], 0
    for i in range(len(cu_seqlens) - 1):
        r += int(cu_seqlens[i + 1] - cu_seqlens[i]) if i in all_rows else 1
        rows.append(r - 1)
    return rows
