"""Every target a request can be sent to, behind one interface (:class:`~router.backends.base.Backend`).

* :mod:`router.backends.base`: the interface, and what a target answers.
* :mod:`router.backends.cloud`: the cloud tier (one gateway or a pool of them) as a backend.

An agent is a backend too: :class:`router.registry.AgentHandle` implements the interface,
sending Work over its AgentLink. The policy (:mod:`router.policy`) chooses among backends
by the same rules whatever they are, and the cascades and the auditor ask them alike.
"""
