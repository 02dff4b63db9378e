"""Session affinity for prefill replicas, as a Ray Serve request router.

A session's turns share a growing prefix, so its prefill goes back to the replica whose
prefix cache holds it, until that replica is saturated (its queue is full); then the least
loaded replica takes the session over. Requests without a session go to the least loaded.
"""
from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, max_sessions: int = 100_000, **kwargs):
        self.max_sessions = max_sessions
        self.bindings: OrderedDict[str, ReplicaID] = OrderedDict()

    @staticmethod
    def session_of(request: PendingRequest | None) -> str | None:
        if request is None:
            return None
        return request.kwargs.get("session_id")

    def _load(self, replica: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return queue_len if queue_len is not None else 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=self._load)
        bound = self.bindings.get(self.session_of(pending_request))
        for replica in candidate_replicas:
            if replica.replica_id == bound and self._load(replica) < replica.max_ongoing_requests:
                return [[replica], [r for r in by_load if r.replica_id != bound]]
        return [[r] for r in by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        session = self.session_of(pending_request)
        if session is None:
            return
        self.bindings[session] = replica_id
        self.bindings.move_to_end(session)
        while len(self.bindings) > self.max_sessions:
            self.bindings.popitem(last=False)
