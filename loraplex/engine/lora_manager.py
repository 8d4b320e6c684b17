"""The adapter cache: device slots (`max_loras`) over a host-memory LRU (`max_cpu_loras`).

Levels:
- store/disk -> host: parsing, validation and conversion run in a background thread (`request_load`,
  `prefetch`), so the step loop never waits on a disk read.
- host -> device slot (`try_acquire`): on a GPU a copy into weights preallocated once for every
  projection; on the CPU the slot refers to the host copy, already in the slot layout, and nothing is
  copied (the host copy lives on while the slot holds it, even after the LRU lets it go).

Requests hold a reference on their adapter's slot while they run; an adapter with references is never
evicted, nor is a pinned one while any slot holds an adapter that is not pinned. The least recently used
idle adapter gives up its slot when a new one needs it.

Scheduler interface (all on the step thread):
    ready(lora)        host-loaded or resident; otherwise starts a background load and says False.
                       Raises the load's error once, so the request can fail with its message.
    try_acquire(lora)  a slot for one more running request, or None when every slot is held.
    release(key)       the request stopped running (finished, aborted or preempted).
    slot_of(key)       for the runner's token-to-slot mapping.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.adapters import TOP_LEVEL, AdapterValidationError, ErrorCode
from loraplex.engine.errors import AdapterLoadError, AdapterMissingError
from loraplex.engine.host_memory import ArenaRecycler, HostArena, aligned, tensor_bytes
from loraplex.engine.lora_layers import LoraProjection, LoraStep, model_projections
from loraplex.engine.lora_request import LoRARequest
from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, fuse_slices

# (layer index, PEFT module name) -> (A [r, in], B [out, r]) with the scaling folded into B
ModuleWeights = Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
LoadFn = Callable[[LoRARequest], ModuleWeights]

PENDING_TTL_S = 10.0


@dataclass
class HostAdapter:
    key: str
    name: str
    rank: int
    # per projection, the weights in the slot layout (`fuse_slices`): A [sum ranks, in], B^T [max rank, out],
    # and the rank of each slice (0 where the adapter does not target it)
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, list[int]]]
    nbytes: int
    arena: HostArena | None = None  # the one allocation `fused` is carved from, where there is one


def _fits(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of `t` is finite in `dtype` (a half-precision slot holds at most 65504)."""
    top = torch.finfo(dtype).max
    t = t.detach().cpu()
    if t.dtype == torch.float32:  # numpy: no OpenMP team started in the loader's thread (see `fuse_slices`)
        return t.numel() == 0 or float(np.abs(t.numpy()).max()) <= top
    return t.numel() == 0 or float(t.abs().max()) <= top


def to_host_adapter(
    lora: LoRARequest, weights: ModuleWeights, projections: Sequence[LoraProjection], max_rank: int, pin: bool,
    dtype: torch.dtype = torch.float32, arenas: ArenaRecycler | None = None,
) -> HostAdapter:
    """Regroup per-module weights into the model's (possibly fused) projections, each in the slot layout:
    the one copy of the adapter made here, off the step loop. On the CPU a slot then refers to these
    tensors (`LoraSlotWeights(views=True)`) and loading into a slot copies nothing. With `arenas` the
    tensors are carved from one arena of the right size (`host_memory`), recycled or new."""
    by_name = {(p.layer_idx, name) for p in projections for name in p.module_names}
    unknown = sorted(k for k in weights if k not in by_name)
    if unknown:
        raise ValueError(f"adapter {lora.name!r} targets modules the model does not have: {unknown[:4]}")
    rank = 0
    # per targeted projection: its slices' (A, B) or None, and their ranks
    chosen: list[tuple[LoraProjection, list[tuple[torch.Tensor, torch.Tensor] | None], list[int]]] = []
    for p in projections:
        per_slice: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for name, out in zip(p.module_names, p.output_sizes, strict=True):
            pair = weights.get((p.layer_idx, name))
            if pair is None:
                per_slice.append(None)
                continue
            a, b = pair
            r = a.shape[0]
            if a.shape != (r, p.in_features) or b.shape != (out, r):
                raise ValueError(
                    f"adapter {lora.name!r} layer {p.layer_idx} {name}: A {tuple(a.shape)} / B {tuple(b.shape)} "
                    f"do not match the model ({p.in_features} -> {out})"
                )
            if r > max_rank:
                raise ValueError(f"adapter {lora.name!r} has rank {r}, above max_lora_rank={max_rank}")
            per_slice.append((a, b))
            rank = max(rank, r)
        if all(s is None for s in per_slice):
            continue
        if dtype != torch.float32:
            for name, pair in zip(p.module_names, per_slice, strict=True):
                if pair is not None and not (_fits(pair[0], dtype) and _fits(pair[1], dtype)):
                    raise ValueError(f"adapter {lora.name!r} layer {p.layer_idx} {name} has weights beyond the "
                                     f"range of {dtype} (the adapter slots' lora_dtype); serve it with lora_dtype "
                                     "float32")
        chosen.append((p, per_slice, [0 if s is None else s[0].shape[0] for s in per_slice]))
    if not chosen:
        raise ValueError(f"adapter {lora.name!r} has no weights for any projection of the model")
    arena = alloc = None
    if arenas is not None and not pin:
        need = sum(aligned(tensor_bytes((sum(r), p.in_features), dtype))
                   + aligned(tensor_bytes((max(r), sum(p.output_sizes)), dtype)) for p, _, r in chosen)
        arena = arenas.take(need)
        alloc = arena.take
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
    nbytes = 0
    for p, per_slice, ranks in chosen:
        fa, fb = fuse_slices(per_slice, p.in_features, p.output_sizes, dtype=dtype, alloc=alloc)
        if pin:
            fa, fb = fa.pin_memory(), fb.pin_memory()
        fused[p.key] = (fa, fb, ranks)
        nbytes += (fa.numel() + fb.numel()) * fa.element_size()
    return HostAdapter(lora.key, lora.name, rank, fused, nbytes, arena)


class LoraManager:
    def __init__(
        self,
        projections: Sequence[LoraProjection],
        load_fn: LoadFn,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if max_cpu_loras < max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        self.projections = list(projections)
        self.load_fn = load_fn
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        # On a GPU, allocated once: loading an adapter is a copy into these, never an allocation. On the
        # CPU the slots are views of the host copies: loading one into a slot copies nothing.
        # The LM head's and the embedding's slots (layer TOP_LEVEL) are made when the first adapter with LoRA
        # on them takes a slot: on a GPU they hold max_loras * max_rank * (vocab + hidden) values each (for
        # SmolLM2, 8 slots of rank 64: 2 x 102 MB in fp32), which adapters without them must not cost.
        self.weights: dict[tuple[int, str], LoraSlotWeights] = {
            p.key: self._slot_weights(p) for p in self.projections if p.layer_idx != TOP_LEVEL
        }
        self._projection = {p.key: p for p in self.projections}
        self._widest = max((w.a_rows for w in self.weights.values()), default=0)
        self._last_step: tuple[list[int], LoraStep | None] | None = None  # (slot list, state) of the last step
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._gate = threading.Condition()  # loads_paused(): the step thread holds loads back
        self._paused = False
        self._executing = False  # a load is running on the pool's thread
        self._finished = 0  # loads finished (or failed), under _gate: wait_for_load() watches it
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # LRU, oldest first
        self._loading: dict[str, Future] = {}  # loads submitted to the pool and not finished
        # loads not started yet, in order of request; those a waiting request needs (`_urgent`) go before
        # prefetches, whatever their order (warming adapters at start must not hold up a request's load)
        self._queued: OrderedDict[str, LoRARequest] = OrderedDict()
        self._urgent: dict[str, None] = {}  # in the order requests came to wait for them
        self._errors: dict[str, BaseException] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self._slot_key: list[str | None] = [None] * max_loras
        self._refs: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._remove_when_idle: set[str] = set()  # removed while requests used it
        self._removed_loading: set[str] = set()  # removed while its load ran: what the load reads is not kept
        # loaded (or loading) for a waiting request that has not run yet -> when it last asked; lapses
        # PENDING_TTL_S after the last ask, so an aborted request cannot hold a place for ever
        self._pending: dict[str, float] = {}
        self.loads_total = self.evictions_total = self.hits_total = self.misses_total = 0
        # the CPU's host copies are what slots read: one arena each, recycled (a GPU copies into its slots)
        self._recycler = ArenaRecycler() if self.device.type == "cpu" else None
        self.source = None  # an AdapterSource when built for an engine: resolves user paths
        self._names: dict[str, LoRARequest] = {}  # register(): names that stand for an adapter version

    def _slot_weights(self, p: LoraProjection) -> LoraSlotWeights:
        return LoraSlotWeights(self.max_loras, p.in_features, p.output_sizes, self.max_rank, dtype=self.dtype,
                               device=self.device, views=self.device.type == "cpu")

    @classmethod
    def for_engine(cls, model: torch.nn.Module, model_dir, config, *, device, dtype) -> LoraManager:
        """The engine's adapter cache: slots for every LoRA-aware projection of `model`, loading from the
        configured store (canonical entries) or the adapters' own files."""
        from loraplex.adapters import AdapterLimits, BaseModelSpec, LocalAdapterStore
        from loraplex.engine.lora_source import AdapterSource

        store = LocalAdapterStore(config.adapter_store) if config.adapter_store else None
        source = AdapterSource(
            BaseModelSpec.from_model_dir(model_dir), store, AdapterLimits(max_rank=config.max_lora_rank)
        )
        manager = cls(
            model_projections(model), source.load, max_loras=config.max_loras,
            max_cpu_loras=max(config.max_cpu_loras, config.max_loras), max_rank=config.max_lora_rank,
            dtype=dtype, device=device,
        )
        manager.source = source
        return manager

    def register(self, name: str, adapter) -> LoRARequest:
        """Let `name` stand for an adapter (a path, validated now, or a LoRARequest) in later `resolve` calls;
        registering a name again points it at the new adapter."""
        if not isinstance(name, str) or not name.strip():
            raise AdapterLoadError(f"an adapter name must be a non-empty string, got {name!r}")
        if not _could_be_a_name(name):
            # a name that reads as a path would make one string mean a folder in one call and other weights
            # in the next
            raise AdapterLoadError(f"adapter name {name!r} looks like a path: a name may not contain '/' or '\\' "
                                   "or start with '.' or '~'")
        if adapter is None or not isinstance(adapter, (str, os.PathLike, LoRARequest)):
            raise AdapterLoadError(f"register {name!r} with a PEFT folder or archive path or a LoRARequest, got "
                                   f"{type(adapter).__name__} {adapter!r}")
        lora = self.resolve(adapter)
        lora = LoRARequest(name=name, content_hash=lora.content_hash, path=lora.path)
        with self._lock:
            self._names[name] = lora
        return lora

    def resolve(self, adapter) -> LoRARequest:
        """A LoRARequest for a registered name (`register`), or for a PEFT folder/archive path (validated now);
        refused with AdapterLoadError."""
        if isinstance(adapter, LoRARequest):
            return adapter
        if isinstance(adapter, str):
            with self._lock:
                named = self._names.get(adapter)
            if named is not None:
                if os.path.exists(adapter):
                    raise AdapterLoadError(f"{adapter!r} is both a registered adapter name and a path here; pass "
                                           f"{os.path.join('.', adapter)!r} for the path, or register another name")
                return named
        if self.source is None:
            raise AdapterLoadError("this adapter cache cannot resolve paths (no adapter source)")
        try:
            lora, canonical = self.source.resolve(adapter)
        except ValueError as exc:
            raise AdapterLoadError(f"adapter {str(adapter)!r} refused: {exc}{self._names_hint(adapter, exc)}") from exc
        if canonical is not None and not self.is_resident(lora.key):
            from loraplex.engine.lora_source import module_weights

            try:
                self.put_host(lora, module_weights(canonical))
            except ValueError as exc:
                raise AdapterLoadError(f"adapter {str(adapter)!r} refused: {exc}") from exc
        return lora

    def _names_hint(self, adapter, exc: Exception) -> str:
        """For a string that is neither a path nor a registered name: the names that are registered, since a
        mistyped name reads as a path that does not exist."""
        if not (isinstance(adapter, str) and isinstance(exc, AdapterValidationError)
                and exc.code == ErrorCode.NOT_FOUND and adapter.strip() and _could_be_a_name(adapter)):
            return ""
        with self._lock:
            names = sorted(self._names)
        if not names:
            return ""
        shown = ", ".join(repr(n) for n in names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        return f", and it is not a registered adapter name either (registered: {shown})"

    # ---- loading (background) -------------------------------------------------------------------------

    def request_load(self, lora: LoRARequest, *, urgent: bool = True) -> Future:
        """Start loading into host memory unless it is there or on its way. Never blocks on the load.
        `urgent`: a request waits for it, so it goes before queued prefetches (False: a prefetch)."""
        with self._lock:
            self._removed_loading.discard(lora.key)  # asked for again: a load under way is kept after all
            fut = self._loading.get(lora.key)
            if fut is not None:
                if urgent and lora.key in self._queued:
                    self._urgent.setdefault(lora.key)
                return fut
            fut = Future()
            if lora.key in self._host or lora.key in self._slot_of:
                fut.set_result(None)
                return fut
            self._errors.pop(lora.key, None)
            self._loading[lora.key] = fut
            self._queued[lora.key] = lora
            if urgent:
                self._urgent.setdefault(lora.key)
            self._pool.submit(self._run_next)
            return fut

    def _run_next(self) -> None:
        """One queued load (the pool runs one per load queued): the first a request came to wait for, else
        the oldest prefetch."""
        with self._lock:
            key = next(iter(self._urgent), None) or next(iter(self._queued), None)
            if key is None:
                return
            lora = self._queued.pop(key)
            self._urgent.pop(key, None)
            fut = self._loading[key]
        if not fut.set_running_or_notify_cancel():
            with self._lock:
                self._loading.pop(key, None)
            return
        try:
            self._load(lora)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the load
            fut.set_exception(exc)
        else:
            fut.set_result(None)

    def _load(self, lora: LoRARequest) -> None:
        with self._gate:
            while self._paused:
                self._gate.wait()
            self._executing = True
        try:
            self._load_unpaused(lora)
        finally:
            with self._gate:
                self._executing = False
                self._finished += 1
                self._gate.notify_all()

    def wait_for_load(self, timeout: float) -> None:
        """Block the step thread until a background load finishes, or `timeout` seconds pass; at once when
        no load is queued or running. A step loop with nothing to run but loads under way calls this
        rather than stepping again at once: spinning would hold the interpreter lock that the loader
        needs for its Python work between file reads and copies (on 2 cores a 100-adapter run with
        reloads spent 70 of its 80 s in 370,000 empty steps while each load crawled)."""
        with self._gate:
            if not self._loading:
                return
            seen = self._finished
            self._gate.wait_for(lambda: self._finished != seen or not self._loading, timeout)

    @contextmanager
    def loads_paused(self) -> Iterator[None]:
        """Hold background loads back while the block runs: a load under way finishes first (the caller
        waits for it), queued loads start after the block. Prefetches and waiting requests keep their
        places; nothing is cancelled."""
        with self._gate:
            self._paused = True
            while self._executing:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._paused = False
                self._gate.notify_all()

    def _load_unpaused(self, lora: LoRARequest) -> None:
        try:
            weights = self.load_fn(lora)
            host = to_host_adapter(
                lora, weights, self.projections, self.max_rank, pin=self.device.type == "cuda", dtype=self.dtype,
                arenas=self._recycler,
            )
        except Exception as exc:
            missing = isinstance(exc, FileNotFoundError) or (
                isinstance(exc, AdapterValidationError) and exc.code == ErrorCode.NOT_FOUND)
            error = (AdapterMissingError if missing else AdapterLoadError)(
                f"adapter {lora.name!r} could not be loaded: {exc}")
            error.__cause__ = exc
            with self._lock:
                if lora.key in self._pending:
                    # for the waiting request (`ready` raises it); a prefetch's failure is its caller's alone,
                    # and a request that comes later tries the load again rather than fail on an old error
                    self._errors[lora.key] = error
                self._loading.pop(lora.key, None)
                self._removed_loading.discard(lora.key)
            raise error from exc
        with self._lock:
            self._loading.pop(lora.key, None)
            if lora.key in self._removed_loading:
                # removed (a delete) while it loaded, and asked for by no request since: not kept, nor given
                # a slot by the prefetch that started the load
                self._removed_loading.discard(lora.key)
                if self._recycler is not None:
                    self._recycler.give(host.arena)
                return
            self._host[lora.key] = host
            self._host.move_to_end(lora.key)
            self.loads_total += 1
            self._trim_host()

    def _trim_host(self) -> None:
        # Oldest first, sparing adapters that are pinned, running, or loaded for a request still waiting;
        # host copies of resident adapters may go (an eviction from the slot then reloads from the store).
        while len(self._host) > self.max_cpu_loras:
            spare = self._pinned | self._pending.keys() | self._refs.keys()
            victim = next((k for k in self._host if k not in spare), next(iter(self._host)))
            dropped = self._host.pop(victim)
            if self._recycler is not None:
                self._recycler.give(dropped.arena)

    def put_host(self, lora: LoRARequest, weights: ModuleWeights) -> None:
        """Hand over weights already read (a path just validated), sparing a second read."""
        host = to_host_adapter(
            lora, weights, self.projections, self.max_rank, pin=self.device.type == "cuda", dtype=self.dtype,
            arenas=self._recycler,
        )
        with self._lock:
            if lora.key not in self._host:
                self.loads_total += 1
            self._host[lora.key] = host
            self._host.move_to_end(lora.key)
            self._trim_host()

    def prefetch(self, lora: LoRARequest, *, pin: bool | None = None) -> Future:
        """Load ahead of traffic: into host memory in the background, then into a free device slot. pin True
        keeps it from eviction, False lets it be evicted again, None leaves that as it was."""
        with self._lock:
            if pin:
                try:
                    self._pin(lora.key, lora.name)
                except AdapterLoadError as exc:
                    refused: Future = Future()
                    refused.set_exception(exc)
                    return refused
            elif pin is False:
                self._pinned.discard(lora.key)
        fut = self.request_load(lora, urgent=False)
        result: Future = Future()

        def _activate(done: Future) -> None:
            if done.cancelled():  # never started: the cache closed first
                result.set_exception(AdapterLoadError(f"adapter {lora.name!r} was not loaded: the adapter cache "
                                                      "closed first"))
                return
            if done.exception() is not None:
                self.unpin(lora.key)
                result.set_exception(done.exception())
                return
            with self._lock:
                if lora.key not in self._slot_of:
                    # Only a free slot: evicting from this thread could race the scheduler's choices.
                    free = self._free_slot()
                    if free is not None and lora.key in self._host:
                        self._activate(lora.key, free)
            result.set_result(self._slot_of.get(lora.key))

        fut.add_done_callback(_activate)
        return result

    @property
    def loading(self) -> bool:
        """Whether a background load is queued or running (it then occupies a CPU core)."""
        return bool(self._loading)

    # ---- scheduler interface (step thread) ----------------------------------------------------------

    def ready(self, lora: LoRARequest, *, load: bool = True) -> bool:
        """See the module's docstring. load=False: never start a load nor take a place for one."""
        now = time.monotonic()
        with self._lock:
            key = lora.key
            if key in self._pending:
                self._pending[key] = now  # its request still waits: keep the loaded copy
            if key in self._slot_of or key in self._host:
                return True
            error = self._errors.pop(key, None)
            if error is not None:
                self._pending.pop(key, None)
                raise error
            if key not in self._pending:
                if not load:
                    return False
                # Loading for every waiting request at once would push adapters loaded for earlier ones
                # out of the host LRU before they ever run: keep at most a slot-cache's worth in flight.
                for k in [k for k, t in self._pending.items() if now - t > PENDING_TTL_S]:
                    del self._pending[k]
                if len(self._pending) >= self.max_loras:
                    return False
                self._pending[key] = now
        self.request_load(lora)
        return False

    def waits_for_place(self, key: str) -> bool:
        """Not loaded, nor loading: `ready` found every place for waiting requests' loads taken."""
        with self._lock:
            return not (key in self._pending or key in self._loading or key in self._host or key in self._slot_of)

    def unwanted(self, key: str) -> None:
        """No waiting request needs the adapter any more (the last one was aborted or failed before it ran):
        it gives up its place among the loads kept for waiting requests at once, rather than hold it for
        PENDING_TTL_S while other requests' adapters wait for a place to load. A load under way goes on (it
        may serve a later request) behind the loads requests wait for."""
        with self._lock:
            self._pending.pop(key, None)
            self._urgent.pop(key, None)

    def is_resident(self, key: str) -> bool:
        return key in self._slot_of

    def slot_of(self, key: str) -> int:
        return self._slot_of[key]

    def try_acquire(self, lora: LoRARequest) -> int | None:
        """A device slot holding `lora` for one more running request; None when no slot can be had now.
        The adapter must be `ready`."""
        with self._lock:
            key = lora.key
            slot = self._slot_of.get(key)
            if slot is not None:
                self.hits_total += 1
            else:
                if key not in self._host:
                    # Dropped from the host LRU since `ready` (or never loaded): fetch it again.
                    self.request_load(lora)
                    return None
                slot = self._free_slot()
                if slot is None:
                    slot = self._evict_one()
                if slot is None:
                    return None
                self.misses_total += 1
                self._activate(key, slot)
            self._slot_of.move_to_end(key)
            self._refs[key] = self._refs.get(key, 0) + 1
            self._pending.pop(key, None)
            return slot

    def slot_to_free(self) -> str | None:
        """Where a request waits for a slot that every running request's adapter holds: the adapter whose slot
        it should get, the one the fewest running requests use (of those not pinned, where there are any;
        `_victim` evicts it once they finish). Once a batch's worth of requests for the adapters in the slots
        went ahead of the waiting one, the scheduler admits no more for this adapter, or a steady stream of
        them would keep the slot held for ever. None when a slot can be had now."""
        with self._lock:
            if self._free_slot() is not None or self._victim() is not None:
                return None
            held = [k for k in self._slot_of if k not in self._pinned] or list(self._slot_of)
            return min(held, key=lambda k: self._refs.get(k, 0), default=None)  # the least recently used of equals

    def release(self, key: str) -> None:
        with self._lock:
            n = self._refs.get(key, 0)
            if n <= 0:
                raise RuntimeError(f"release of adapter {key[:12]} without a matching acquire")
            if n == 1:
                del self._refs[key]
                if key in self._remove_when_idle:  # removed while running: it goes now
                    self._remove_when_idle.discard(key)
                    self._drop(key)
            else:
                self._refs[key] = n - 1

    def refcount(self, key: str) -> int:
        return self._refs.get(key, 0)

    def pin(self, key: str) -> None:
        with self._lock:
            self._pin(key, key[:12])

    def _pin(self, key: str, name: str) -> None:
        # Pinned adapters stay in host memory, which holds max_cpu_loras: past that, each load would drop
        # a pinned one while it still counted as pinned.
        if key not in self._pinned and len(self._pinned) >= self.max_cpu_loras:
            raise AdapterLoadError(f"cannot pin adapter {name!r}: {len(self._pinned)} adapters are pinned already, "
                                   f"as many as the host cache holds (max_cpu_loras={self.max_cpu_loras}); unpin "
                                   "one or raise max_cpu_loras")
        self._pinned.add(key)

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pinned.discard(key)

    def remove(self, key: str) -> bool:
        """Drop the adapter from every level if no request uses it. Returns False while it is in use: it is
        then dropped when the last request using it stops (requests still waiting load it again)."""
        with self._lock:
            if self._refs.get(key):
                self._pinned.discard(key)
                self._remove_when_idle.add(key)
                return False
            self._drop(key)
            if key in self._loading:
                self._removed_loading.add(key)
            return True

    def _drop(self, key: str) -> None:
        self._pinned.discard(key)
        self._pending.pop(key, None)
        dropped = self._host.pop(key, None)
        if dropped is not None and self._recycler is not None:
            self._recycler.give(dropped.arena)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._clear(slot)

    def build_step(self, token_slots: Sequence[int] | torch.Tensor) -> LoraStep | None:
        """The forward context's LoRA state for a step; None when no token uses an adapter.

        Successive decode steps of the same running requests have the same slot list: the previous step's
        state is then reused (it holds the grouping and a scratch buffer, nothing that a slot's contents
        change: the kernels read the slot tables, which loads update in place, at every call)."""
        slots = token_slots.reshape(-1).tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        last = self._last_step
        if last is not None and last[0] == slots:
            return last[1]
        batch = LoraBatch.build(slots, device=self.device)
        step = None if batch.empty else LoraStep(batch, self.weights, self._widest)
        self._last_step = (slots, step)
        return step

    # ---- blocking convenience (benchmarks, offline use) ---------------------------------------------

    def load_now(self, lora: LoRARequest) -> int:
        """Load and place into a slot on the calling thread; returns the slot (not referenced)."""
        try:
            self.request_load(lora).result()
        finally:
            with self._lock:
                self._errors.pop(lora.key, None)
        with self._lock:
            slot = self.try_acquire(lora)
            if slot is None:
                raise RuntimeError("every LoRA slot is in use")
            self.release(lora.key)
            return slot

    # ---- internals ----------------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        for slot, key in enumerate(self._slot_key):
            if key is None:
                return slot
        return None

    def _victim(self) -> str | None:
        # The least recently used idle adapter that is not pinned. Pins never take every slot: where each
        # slot holds a pinned adapter, the least recently used idle one gives its slot up (it stays pinned in
        # host memory and comes back on its next request), or every other adapter would wait forever.
        victim = next((k for k in self._slot_of if not self._refs.get(k) and k not in self._pinned), None)
        if victim is None and all(k in self._pinned for k in self._slot_of):
            victim = next((k for k in self._slot_of if not self._refs.get(k)), None)
        return victim

    def _evict_one(self) -> int | None:
        victim = self._victim()
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        self._clear(slot)
        self.evictions_total += 1
        return slot

    def _activate(self, key: str, slot: int) -> None:
        host = self._host[key]
        for pkey in host.fused.keys() - self.weights.keys():
            # LoRA on the LM head or embedding, for the first time: their slots, for every slot at once. The
            # dict is the one every step's LoraStep reads, so steps see them from now on.
            w = self._slot_weights(self._projection[pkey])
            self._widest = max(self._widest, w.a_rows)
            self.weights[pkey] = w
        for pkey, w in self.weights.items():
            fused = host.fused.get(pkey)
            if fused is None:
                w.clear_slot(slot)
            else:
                w.set_slot_fused(slot, *fused)
        self._slot_key[slot] = key
        self._slot_of[key] = slot
        self._host.move_to_end(key)

    def _clear(self, slot: int) -> None:
        for w in self.weights.values():
            w.clear_slot(slot)
        self._slot_key[slot] = None

    def stats(self) -> dict:
        with self._lock:
            return {
                "lora_slots_total": self.max_loras,
                "lora_slots_used": len(self._slot_of),
                "lora_resident": list(self._slot_of),
                "lora_host_cached": list(self._host),
                "lora_loads_total": self.loads_total,
                "lora_evictions_total": self.evictions_total,
                "lora_hits_total": self.hits_total,
                "lora_misses_total": self.misses_total,
                "lora_pinned": sorted(self._pinned),  # surfaces in EngineStats.extra for the console
            }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # loads that never started: whoever waits on them is told
            for key in list(self._queued):
                self._loading.pop(key).cancel()
            self._queued.clear()
            self._urgent.clear()


def _could_be_a_name(adapter: str) -> bool:
    """A registered name may not read as a path: no '/' or '\\', not starting with '.' or '~'."""
    return not ("/" in adapter or "\\" in adapter or adapter.startswith((".", "~")))
