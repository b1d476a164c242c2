"""The adapters an executor knows, and the few resident in its stacks' slots (LRU beyond them).

Known adapters are those loaded at start (``--lora``) or while serving (``register``); at most
``num_slots`` are resident. A step asks for the slots of the adapters its rows use
(``slots_for``): a resident one is used in place (and becomes the most recently used), one that
is not takes a free slot or the least recently used one no row of this step needs; an adapter
evicted before is read from its directory again (and must still be the same files).

``register`` and ``unregister`` run on the service's event loop, ``slots_for`` on the step
thread: a lock keeps the tables consistent, and only the step thread writes the stacks, so a
step's forward never sees a slot change under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from services.runtime.lora.adapter import AdapterError, LoraAdapter
from services.runtime.lora.stacks import LoraStacks


class AdapterRegistry:
    def __init__(self, make_stacks: Callable[[], LoraStacks], num_slots: int,
                 reload: Callable[[LoraAdapter], LoraAdapter]) -> None:
        self._make_stacks = make_stacks
        self.stacks: LoraStacks | None = None
        """Allocated when the first adapter is registered: an executor serving none holds none."""
        self.num_slots = num_slots
        self._reload = reload
        """Reads an evicted adapter's files again (adapter.load_adapter with the model's limits)."""
        self._known: dict[str, LoraAdapter] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()
        """name -> slot, least recently used first."""
        self._lock = threading.Lock()
        self.loads = 0
        """Adapters copied into a slot so far (a first use, or a use after an eviction)."""

    def register(self, adapter: LoraAdapter) -> None:
        """Know ``adapter`` (replacing one of its name: its slot is written again at its next use)."""
        with self._lock:
            if self.stacks is None:
                self.stacks = self._make_stacks()
            self._known[adapter.name] = adapter
            self._resident.pop(adapter.name, None)

    def unregister(self, name: str) -> bool:
        """Forget ``name``; whether it was known. Its running sequences fail at their next step."""
        with self._lock:
            self._resident.pop(name, None)
            return self._known.pop(name, None) is not None

    def known(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._known.values())

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        with self._lock:
            return list(self._resident)

    def slots_for(self, names: Iterable[str]) -> tuple[dict[str, int], dict[str, str]]:
        """The slot of each adapter named (loading those not resident), and why for those that
        cannot have one: unknown (unloaded), its files gone or changed, or more adapters in
        the step than slots."""
        slots: dict[str, int] = {}
        errors: dict[str, str] = {}
        wanted = sorted(set(names))
        with self._lock:
            for name in wanted:
                if name in self._resident:
                    self._resident.move_to_end(name)
                    slots[name] = self._resident[name]
            for name in wanted:
                if name in slots:
                    continue
                adapter = self._known.get(name)
                if adapter is None:
                    errors[name] = f"adapter {name!r} is not loaded on this executor (it was unloaded)"
                    continue
                slot = self._free_slot(set(wanted))
                if slot is None:
                    errors[name] = (f"adapter {name!r}: the step uses more adapters than this executor's "
                                    f"max_loras={self.num_slots} slots")
                    continue
                try:
                    self._write(slot, adapter)
                except AdapterError as exc:
                    errors[name] = str(exc)
                    continue
                self._resident[name] = slot
                slots[name] = slot
        return slots, errors

    def _free_slot(self, keep: set[str]) -> int | None:
        used = set(self._resident.values())
        free = next((slot for slot in range(self.num_slots) if slot not in used), None)
        if free is not None:
            return free
        victim = next((name for name in self._resident if name not in keep), None)
        return None if victim is None else self._resident.pop(victim)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        if adapter.weights is None:  # evicted before: read again, and it must be the same adapter
            fresh = self._reload(adapter)
            if fresh.fingerprint != adapter.fingerprint:
                raise AdapterError(f"adapter {adapter.name!r}: the files in {adapter.path} changed since it was "
                                   f"loaded; load it again")
            adapter.weights = fresh.weights
        self.stacks.write(slot, adapter)
        adapter.weights = None  # the slot holds them now; an eviction reads the files again
        self.loads += 1
