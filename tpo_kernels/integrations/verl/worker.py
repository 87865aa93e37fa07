"""Importing this module makes verl's actor record each mini-batch before training it, so that the
``tpo`` policy loss is exact under any micro-batching (:mod:`.mini_batch`).

Enable it with ``actor_rollout_ref.model.external_lib=tpo_kernels.integrations.verl.worker``: verl
imports that module in each actor worker while building the model config, before it builds the
actor's training worker, which is then :class:`TPOTrainingWorker` (verl 0.9.1's engine workers,
under the v1 and the legacy trainer). The record runs only when the actor's policy loss is one of
tpo_kernels' and a rank's mini-batch spans several micro-batches; other losses train as before.
"""

from __future__ import annotations

import functools

from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from .mini_batch import train_batch_for_tpo


class TPOTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` whose engine records each TPO mini-batch before training it."""

    def __init__(self, config):
        super().__init__(config)
        self.engine.train_batch = functools.partial(train_batch_for_tpo, self.engine, self.engine.train_batch)


if ActorRolloutRefWorker.actor_worker_cls not in (TrainingWorker, TPOTrainingWorker):
    raise ImportError(
        "tpo_kernels.integrations.verl.worker: verl's ActorRolloutRefWorker.actor_worker_cls is already "
        f"{ActorRolloutRefWorker.actor_worker_cls.__qualname__} (another extension); TPO's mini-batch record needs "
        "it to be TPOTrainingWorker"
    )
ActorRolloutRefWorker.actor_worker_cls = TPOTrainingWorker
