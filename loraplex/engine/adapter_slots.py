"""What the engine core needs from the adapter cache (implemented by `LoraManager`).

The scheduler treats device slots as a resource: each running sequence holds its adapter's slot (acquired
at admission, released when it finishes, is aborted or preempted), so an adapter in use is never evicted
and a step never references more adapters than there are slots. A request whose adapter is not ready
triggers its load and waits without holding up others. The runner asks for each adapter's slot and for
the step's LoRA state that the LoRA-aware projections call.

Where the cache has them (`LoraManager` does), the scheduler also calls, for fairness between waiting requests:
`slot_to_free()` (the adapter to drain when a request waits for a slot every running request holds),
`waits_for_place(key)` with `ready(lora, load=False)` (a load place freed mid-step stays for the tenant that
asked first), and `unwanted(key)` (no waiting request needs the adapter's load any more).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from loraplex.engine.forward_context import LoraStepState
    from loraplex.engine.lora_request import LoRARequest


@runtime_checkable
class AdapterSlots(Protocol):
    def ready(self, lora: LoRARequest) -> bool:
        """Loaded far enough to take a slot now; otherwise starts the load (never blocks) and says False.
        Raises AdapterLoadError when an earlier load of it failed."""
        ...

    def try_acquire(self, lora: LoRARequest) -> int | None:
        """A slot holding the adapter, referenced once more; None when every slot is held by others."""
        ...

    def release(self, key: str) -> None:
        ...

    def slot_of(self, key: str) -> int:
        ...

    @property
    def loading(self) -> bool:
        """A background load is under way (on a CPU engine a step then leaves it a core, or pauses it)."""
        ...

    def loads_paused(self) -> AbstractContextManager[None]:
        """Hold background loads back for the duration of a large step."""
        ...

    def wait_for_load(self, timeout: float) -> None:
        """Block until a background load finishes, or `timeout` seconds pass (at once when none runs)."""
        ...

    def build_step(self, token_slots: torch.Tensor) -> LoraStepState | None:
        """LoRA state for one step, from each token's slot (-1: base model); None when no token has one."""
        ...
