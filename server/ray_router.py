"""PrefixAffinityRouter: a Ray Serve request router that sends requests sharing a prompt prefix to one replica,
so they meet the KV blocks its prefix cache already holds.

The key is computed by the ingress (server/ray_serve.py: a hash of the prompt's first `prefix_chars`
characters) and carried as the request's `prefix_key`. The replicas are ranked by rendezvous hashing
(highest hash of key + replica id first): every router in the cluster ranks them alike without sharing state,
keys spread evenly, and when a replica dies or one is added only the keys it owned move. The first choice is
tried first; if it is at max_ongoing_requests the others are (least loaded of them), so affinity never queues
a request behind a full replica while another has room. A request without a key goes to the less loaded of
two random replicas (power of two choices, Ray's default).

Ray's router hands a chosen replica to the oldest request waiting to be routed, which under concurrency need
not be the one the replica was chosen for (its key's replica); this router claims the replica for the request
it chose it for, as Ray's multiplexing router does for a model id.
"""
from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rendezvous_weight(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def rank_replicas(key: str, replica_ids: list[str]) -> list[str]:
    """The replica ids, the key's owner first (highest rendezvous weight)."""
    return sorted(replica_ids, key=lambda rid: rendezvous_weight(key, rid), reverse=True)


def request_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prefix_key", None)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._choosing: dict[str, PendingRequest] = {}  # internal request id -> the request being routed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = request_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in rank_replicas(key, list(by_id))]
        if len(self._choosing) > 10_000:  # requests cancelled before they were routed
            self._choosing = {k: p for k, p in self._choosing.items() if not p.future.done()}
        self._choosing[pending_request.metadata.internal_request_id] = pending_request
        return [ranked[:1], ranked[1:]]

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        """The replica just chosen goes to the request it was chosen for, if that one still waits."""
        if request_metadata is None:
            return None
        own = self._choosing.pop(request_metadata.internal_request_id, None)
        return own if own is not None and not own.future.done() else None

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self._choosing.pop(pending_request.metadata.internal_request_id, None)
