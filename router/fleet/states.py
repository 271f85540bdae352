"""Where each agent the registry lists stands: ready, draining or lost, then forgotten, and the
heartbeats that keep a linked agent ready.

An agent moves between these states for many askers: its link (Draining, a broken stream), an
operator (Drain, Undrain, Forget), the router's heartbeat sweep (silence, a link it stops
reading) and the registry itself (a reconnect replaces the old link). Whoever asks, a move has
the same duties: keep the index's ready pools, the count of linked agents and the heartbeat pace
in step, fail over what a lost agent held, and tell Fleet.Watch.

Heartbeats cost the router a bounded rate: the interval the router asks for (the pace)
doubles each time the fleet would otherwise send more than ``max_heartbeats_per_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from router.fleet.agent_handle import AgentHandle, State
from router.fleet.family_book import FamilyBook
from router.fleet.index import AgentIndex
from stratus.errors import ConfigError, NotFound
from stratus.obs.stats import LoadReport

log = logging.getLogger("stratus.registry")

MISSED_HEARTBEATS = 3
# A lost agent stays listed (state lost) this long, then is forgotten.
FORGET_LOST_S = 600.0
# Lost agents kept for status beyond this many: the oldest are forgotten first.
MAX_LOST = 4096


def pace_for(agents: int, *, base_s: float, max_per_s: float) -> float:
    """The heartbeat interval for a fleet of ``agents``: ``base_s`` doubled until the whole
    fleet sends at most ``max_per_s`` heartbeats a second (steps, so it rarely changes)."""
    pace = base_s
    while agents / pace > max_per_s:
        pace *= 2
    return pace


class AgentStates:
    """The moves of a listed agent between ready, draining and lost, and out of the list.

    Kept apart from :class:`router.fleet.registry.FleetRegistry`, which admits agents and reads
    the fleet, so that when an agent counts as gone, and what its going costs, is decided in one
    place. It shares the registry's ``agents``, ``index`` and ``book`` (as
    :class:`router.fleet.hello.Admission` does), and owns the count of linked agents and the
    heartbeat pace that follows it.
    """

    def __init__(
        self,
        agents: dict[str, AgentHandle],
        index: AgentIndex[AgentHandle],
        book: FamilyBook,
        *,
        heartbeat_s: float,
        max_heartbeats_per_s: float,
        clock: Callable[[], float],
        changed: Callable[[], None],
    ) -> None:
        self._agents = agents
        self._index = index
        self._book = book
        self._clock = clock
        self._changed = changed  # Fleet.Watch told
        self.heartbeat_s = heartbeat_s  # the pace of a fleet small enough
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.pace_s = heartbeat_s  # the interval agents are asked for now
        self._linked = 0  # agents not lost

    # -- joining, draining and leaving -----------------------------------------------------
    def joined(self, handle: AgentHandle) -> None:
        """List a new agent, ready; the fleet's pace follows its size."""
        self._agents[handle.id] = handle
        self._index.add(handle)
        self._index.ready(handle)
        self._linked += 1
        self._repace()

    def draining(self, handle: AgentHandle) -> None:
        if handle.state == State.READY:
            handle.state = State.DRAINING
            self._index.unready(handle)
            log.info("agent %s is draining", handle.id)
            self._changed()

    def lose(self, handle: AgentHandle, reason: str) -> None:
        """The agent's link is gone: fail over its requests at once."""
        if self._agents.get(handle.id) is not handle or handle.state == State.LOST:
            return
        handle.left = handle.state == State.DRAINING  # it said goodbye first: not a fault
        handle.state = State.LOST
        handle.lost_at = self._clock()
        self._index.unready(handle)
        self._linked -= 1
        handle.work.fail(reason)
        handle.settle_reloads(f"agent lost: {reason}")
        handle.work.outbox.put_nowait(None)
        if handle.left:
            log.info("agent %s left (it drained first): %s", handle.id, reason)
        else:
            log.warning("agent %s lost: %s", handle.id, reason)
        self._drop_oldest_lost()
        self._repace()
        self._changed()

    def drop(self, handle: AgentHandle) -> None:
        """Drop a lost agent, and the description of each family no listed agent serves now."""
        if self._agents.get(handle.id) is handle:
            del self._agents[handle.id]
            self._index.forget(handle)
            for family in {info.family for info in handle.variants.values()}:
                if not self._index.tiers(family) and not self._index.variants_of(family):
                    self._book.undescribe(family)

    def _drop_oldest_lost(self) -> None:
        """Keep at most MAX_LOST lost agents listed: agents that join and leave in bulk must
        not grow the router without bound."""
        lost = [h for h in self._agents.values() if h.state == State.LOST]
        for handle in sorted(lost, key=lambda h: h.lost_at)[: max(0, len(lost) - MAX_LOST)]:
            self.drop(handle)

    # -- an operator's marks -----------------------------------------------------------------
    def check_mark(self, agent_id: str, mark: str) -> AgentHandle:
        """The agent an operator's drain, undrain or forget names, if it may be done here:
        NotFound or ConfigError saying why not (asked before a site-wide mark is written)."""
        handle = self._agents.get(agent_id)
        if mark == "forgotten":
            if handle is None:
                raise NotFound(f"no agent '{agent_id}' is listed")
            if handle.state != State.LOST:
                raise ConfigError(
                    f"agent {agent_id} is {handle.state}: only a lost or left agent is forgotten"
                )
            return handle
        if handle is None or handle.state == State.LOST:
            raise NotFound(f"no linked agent '{agent_id}'")
        if mark == "ready" and (handle.state != State.DRAINING or not handle.operator_drained):
            raise ConfigError(
                f"agent {agent_id} is {handle.state}, not drained by an operator: nothing to take back"
            )
        return handle

    def drain(self, agent_id: str) -> AgentHandle:
        handle = self.check_mark(agent_id, "drained")
        handle.work.ask_drain("drained by operator")
        handle.operator_drained = True
        self.draining(handle)
        return handle

    def undrain(self, agent_id: str) -> AgentHandle:
        """An operator's Drain taken back; an agent draining because it is stopping stays so."""
        handle = self.check_mark(agent_id, "ready")
        handle.operator_drained = False
        handle.state = State.READY
        self._index.ready(handle)
        log.info("agent %s is ready again (undrained by an operator)", agent_id)
        self._changed()
        return handle

    def forget(self, agent_id: str) -> AgentHandle:
        """A lost or left agent dropped from the status now."""
        handle = self.check_mark(agent_id, "forgotten")
        self.drop(handle)
        self._changed()
        return handle

    # -- heartbeats and their pace -------------------------------------------------------
    def heartbeat(self, handle: AgentHandle, beat: LoadReport) -> None:
        handle.last_heartbeat = self._clock()
        if unread := handle.not_reading(beat.received, MISSED_HEARTBEATS):  # it heartbeats, yet reads nothing
            self.lose(
                handle, f"not reading its link: {unread} messages unread for {MISSED_HEARTBEATS} heartbeats"
            )
        handle.reported_queue = beat.queue_length
        handle.update_latency(beat.latency)

    def check_heartbeats(self) -> None:
        """Mark silent agents lost; forget agents lost for longer than FORGET_LOST_S."""
        now = self._clock()
        for handle in list(self._agents.values()):
            if handle.state != State.LOST:
                if now - handle.last_heartbeat > MISSED_HEARTBEATS * handle.heartbeat_s:
                    self.lose(handle, f"missed {MISSED_HEARTBEATS} heartbeats")
            elif now - handle.lost_at > FORGET_LOST_S:
                self.drop(handle)
                self._changed()

    def _repace(self) -> None:
        """Tell every linked agent the new interval when the fleet's size crosses a step."""
        pace = pace_for(self._linked, base_s=self.heartbeat_s, max_per_s=self.max_heartbeats_per_s)
        if pace == self.pace_s:
            return
        log.info("fleet of %d agents: heartbeats every %.1f s (was %.1f s)", self._linked, pace, self.pace_s)
        slower, self.pace_s = pace > self.pace_s, pace
        now = self._clock()
        for handle in self._agents.values():
            if handle.state == State.LOST:
                continue
            handle.work.set_pace(pace)
            handle.heartbeat_s = pace
            if not slower:  # time silence from the new pace, not from the old, longer gap
                handle.last_heartbeat = max(handle.last_heartbeat, now)
