"""Hosting the trainer ranks: as Ray actors in the actor placement group, or locally, in the controller
process or in a process of its own (`rank_process.py`).

Both hosts offer the same calls to the controller (`TrainerGroup`): train_step, broadcast_weights,
save_checkpoint, load_checkpoint. Every call goes to all ranks at once (FSDP collectives need every
rank); rank 0's answer is returned.
Invariants: the weight-broadcast group lives on rank 0 only, beside (not instead of) the ranks'
default FSDP group; the screenshots of a batch handed to `train_step` are freed in the PixelStore
(one free per reference, by rank 0) when the step returns — the batch is consumed, so the store holds
only the in-flight working set between steps.
"""

from __future__ import annotations

import os
from typing import Any

from asyncwebrl.pixelstore.base import PixelStore


class TrainerRank:
    """One trainer rank: an FSDPActor plus, on rank 0, the weight broadcaster to train-rollout servers."""

    def __init__(self, actor_cfg, rank: int, world_size: int, master_addr: str, master_port: int,
                 device: str = "cpu", cpu_threads: int | None = None, multi_node: bool = False,
                 same_device: bool = False, wire_dtype: str | None = None, memory_fraction: float | None = None):
        """`same_device`: this rank shares its device with train-rollout server `rank` (the shared-device
        layout): weights go to that server through handles to this rank's memory (`weights/ipc.py`),
        in `wire_dtype`; `memory_fraction` caps this rank's share of its GPU (the server's is kept free)."""
        import torch

        if memory_fraction is not None and device.startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(memory_fraction, torch.device(device))
        if cpu_threads:
            # Ray pins fractional-CPU actors to one thread; the trainer needs the cores it shares.
            torch.set_num_threads(cpu_threads)
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
        from asyncwebrl.net import collective_interface_env, node_address
        from asyncwebrl.training.actor import FSDPActor

        if multi_node:  # FSDP and the weight group talk over this node's address, not a loopback
            os.environ.update(collective_interface_env(node_address(True)))

        self.rank = rank
        self.cfg = actor_cfg
        self.master_addr = master_addr
        self.multi_node = multi_node
        self.same_device, self.wire_dtype = same_device, wire_dtype
        self.actor = FSDPActor(actor_cfg, rank=rank, world_size=world_size, master_addr=master_addr,
                               master_port=master_port, device=device)
        self.broadcaster = None

    def ready(self) -> bool:
        return True

    def train_step(self, groups, pixel_store: PixelStore | None = None, version: int | None = None) -> dict[str, Any]:
        """One update on the consumed groups; rank 0 then frees their screenshots in the store (the
        controller copied the viewer's kept episodes out before this call, so it holds no reference).
        `version`: the owner's value, checked against the weights this rank holds."""
        return self.actor.train_step(groups, pixel_store=pixel_store, free_pixels=True, version=version)

    def warm_start(self, samples, ws_cfg) -> list:
        """Behaviour cloning on the demonstrations (`training.warm_start.bc_epochs`); the version stays."""
        from asyncwebrl.training.warm_start import bc_epochs

        return bc_epochs(self.actor, samples, ws_cfg)

    def init_weight_group(self, server_addresses: list[str], api_key: str | None, master_port: int | None = None) -> None:
        if self.same_device:  # every rank feeds the server on its own device; no group, no network
            self._init_same_device(server_addresses[self.rank], api_key)
            return
        if self.rank != 0:
            return
        from asyncwebrl.net import node_address
        from asyncwebrl.weights.sender import WeightSender

        if self.broadcaster is not None:  # re-forming the group (a server died or came back): drop the old one
            self.broadcaster.close()
            self.broadcaster = None
        # NCCL from the trainer's GPU when it has one, gloo from CPU memory otherwise; the servers dial
        # this rank's node: its Ray node IP when the cluster spans nodes
        self.broadcaster = WeightSender(server_addresses, api_key, master_address=node_address(self.multi_node),
                                        master_port=master_port or 0, device=str(self.actor.device),
                                        bucket_mb=self.cfg.weight_chunked_mem_mb,
                                        timeout_s=self.cfg.weight_update_timeout_s)
        self.broadcaster.init_group()

    def _init_same_device(self, server: str, api_key: str | None) -> None:
        import torch

        from asyncwebrl.weights.ipc import SameDeviceSender

        if self.broadcaster is not None:
            self.broadcaster.close()
        self.broadcaster = SameDeviceSender(server, api_key, device=str(self.actor.device),
                                            bucket_mb=self.cfg.weight_chunked_mem_mb,
                                            timeout_s=self.cfg.weight_update_timeout_s,
                                            wire_dtype=getattr(torch, self.wire_dtype) if self.wire_dtype else None)
        self.broadcaster.init_group()

    def broadcast_weights(self):
        """Send the weights to the servers, gathered one parameter at a time as the buckets fill (all
        ranks take part in the gathers); rank 0's TransferReport, None on the other ranks. The version
        is not sent here: the refresh bracket sets it on the servers once every bucket landed."""
        if self.same_device:  # each rank to the server beside it
            if self.broadcaster is None:
                raise RuntimeError("broadcast_weights before init_weight_group")
            resident = self.actor.resident_parameters()
            if resident is not None:  # one rank, parameters whole: the server copies from them directly
                return self.broadcaster.transfer(resident, resident=True)
            # sharded: every rank gathers the full tensors and packs them into flat buckets
            return self.broadcaster.transfer(self.actor.iter_full_parameters(), meta=self.actor.parameter_meta())
        named = self.actor.iter_full_parameters()
        if self.rank != 0:
            for _ in named:  # the other ranks' side of each gather
                pass
            return None
        if self.broadcaster is None:
            raise RuntimeError("broadcast_weights before init_weight_group")
        return self.broadcaster.transfer(named, meta=self.actor.parameter_meta())

    def save_checkpoint(self, root: str, extra_state: dict[str, Any], keep_last: int | None = None,
                        background: bool = False) -> str | None:
        path = self.actor.save_checkpoint(root, extra_state=extra_state, keep_last=keep_last, background=background)
        return str(path) if path is not None else None

    def flush_checkpoints(self) -> None:
        self.actor.flush_checkpoints()

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.actor.load_checkpoint(path)

    def pid(self) -> int:
        return os.getpid()

    def weights_checksum(self) -> str:
        """sha256 of this rank's full weights (`params_checksum`): equal to a server's
        GET /weights_checksum when the server holds bit-identical weights."""
        from asyncwebrl.inference.engine import params_checksum

        return params_checksum(self.actor.full_named_parameters())

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
        self.actor.close()


class TrainerGroup:
    """The controller's handle on all ranks, whichever scheduler hosts them."""

    def __init__(self, ranks: list[Any], remote: bool):
        self.ranks = ranks
        self.remote = remote

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        if not self.remote:
            return [getattr(r, method)(*args, **kwargs) for r in self.ranks]
        import ray

        return ray.get([getattr(r, method).remote(*args, **kwargs) for r in self.ranks])

    def train_step(self, groups, pixel_store: PixelStore | None = None, version: int | None = None) -> dict[str, Any]:
        return self._all("train_step", groups, pixel_store, version)[0]

    def warm_start(self, samples, ws_cfg) -> list:
        """Rank 0's per-epoch `WarmStartEpoch` records (every rank clones the same demonstrations)."""
        return self._all("warm_start", samples, ws_cfg)[0]

    def init_weight_group(self, server_addresses: list[str], api_key: str | None) -> None:
        self._all("init_weight_group", server_addresses, api_key)

    def weights_checksum(self) -> str:
        """Rank 0's `TrainerRank.weights_checksum` (wherever the rank lives)."""
        return self._all("weights_checksum")[0]

    def broadcast_weights(self):
        """Rank 0's `TransferReport`."""
        return self._all("broadcast_weights")[0]

    def save_checkpoint(self, root: str, extra_state: dict[str, Any], keep_last: int | None = None,
                        background: bool = False) -> str | None:
        """Rank 0's checkpoint path; with `background` it is complete only after `flush_checkpoints`
        (or when `latest_complete_checkpoint` shows it)."""
        return self._all("save_checkpoint", root, extra_state, keep_last, background)[0]

    def flush_checkpoints(self) -> None:
        self._all("flush_checkpoints")

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self._all("load_checkpoint", path)[0]

    def close(self) -> None:
        try:
            self._all("close")
        except Exception:
            pass


def local_rank_in_own_process(cfg) -> bool:
    """Does scheduler.type=local host the trainer rank in a process of its own
    (`scheduler.trainer_process`; auto: when rollout threads run beside training on GPUs)?"""
    how = cfg.scheduler.trainer_process
    if how == "auto":
        return cfg.rollout.mode == "async" and cfg.cluster.n_gpus_per_node > 0
    return how == "own"


def start_trainer(cfg, scheduler=None, device: str = "cpu") -> TrainerGroup:
    """Start actor.world_size ranks: Ray actors in the actor placement group, or one local rank, in the
    controller process or a process of its own (`local_rank_in_own_process`; several local ranks are
    spawned by the FSDP tests' launcher, not by the controller)."""
    from asyncwebrl.net import LOOPBACK, free_port

    world = cfg.allocation.actor.world_size
    from asyncwebrl.scheduling.budget import core_budget
    from asyncwebrl.scheduling.fit import shares_device

    threads = core_budget(cfg).trainer_threads
    same = dict(same_device=shares_device(cfg.allocation), wire_dtype=cfg.inference.dtype,
                memory_fraction=(1.0 - cfg.inference.mem_fraction_static
                                 if shares_device(cfg.allocation) and cfg.cluster.n_gpus_per_node else None))
    if scheduler is None:
        if world != 1:
            raise NotImplementedError(
                "scheduler.type=local hosts one trainer rank in the controller process; use scheduler.type=ray "
                "for fsdp[actor]:dN with N > 1"
            )
        args = (cfg.actor, 0, 1, LOOPBACK, free_port(LOOPBACK), device)
        if local_rank_in_own_process(cfg):
            from asyncwebrl.scheduling.rank_process import ProcessRank

            return TrainerGroup([ProcessRank(TrainerRank, *args, cpu_threads=threads, **same)], remote=False)
        return TrainerGroup([TrainerRank(*args, cpu_threads=threads, **same)], remote=False)
    import ray

    # the rendezvous is rank 0's node address (its Ray node IP when the cluster spans nodes)
    master_addr, port = scheduler.bundle_address_and_port("actor", 0)
    remote_cls = ray.remote(max_restarts=0)(TrainerRank)
    ranks = [scheduler.start("actor", remote_cls, cfg.actor, r, world, master_addr, port,
                             "cuda:0" if cfg.cluster.n_gpus_per_node else "cpu", threads, scheduler.spans_nodes,
                             same["same_device"], same["wire_dtype"], same["memory_fraction"], index=r)
             for r in range(world)]
    ray.get([r.ready.remote() for r in ranks])
    return TrainerGroup(ranks, remote=True)
