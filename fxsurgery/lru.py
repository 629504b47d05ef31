"""A mapping with a bound: the caches of fxsurgery keep at most so many entries, forgetting the least recently used
first, so a long-lived process (a model called with ever new signatures, many models analysed) does not grow
without end. A forgotten entry is worked out again when next needed."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


class LruCache(Generic[Key, Value]):
    """At most ``limit`` entries; reading or writing an entry makes it the most recently used, and a new entry past
    the limit forgets the least recently used one."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a cache holds one entry at least, not {limit}")
        self.limit = limit
        self._entries: OrderedDict[Key, Value] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __getitem__(self, key: Key) -> Value:
        value = self._entries[key]
        self._entries.move_to_end(key)
        return value

    def __setitem__(self, key: Key, value: Value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def get(self, key: Key, default: Value | None = None) -> Value | None:
        return self[key] if key in self._entries else default

    def get_or_make(self, key: Key, make: Callable[[], Value]) -> Value:
        """The entry of ``key``, made by ``make()`` and kept if there is none."""
        if key not in self._entries:
            self[key] = make()
        return self[key]

    def keys(self) -> list[Key]:
        """The keys, least recently used first."""
        return list(self._entries)
