"""Where a rank's peer buffers come from, and where its CTAs run.

A rank's mono launch pushes into T flat uint8 buffers of one size
(mono.peer_regions: parity 0, parity 1, flags), one per rank, and reads only
its own. Flags start at zero and are never cleared, so every provider below
hands out zeroed buffers, and the T ranks must use buffers of the same build
(the same T, S and options: the same byte size).

* ``local_buffers``: T ordinary tensors in one process, for ranks that share
  a device (loopback, and T ranks launched concurrently on green contexts).
* ``host_shared_buffers``: T CPU tensors in shared memory, made by the parent
  before it spawns T processes: CPU-interpreter ranks in separate processes.
  The interpreter's atomics are the host's atomics on that memory, so the
  protocol (flags, counts, parities) is the one the GPU runs.
* ``symmetric_buffers``: ``torch.distributed._symmetric_memory`` (``empty``,
  ``rendezvous``, ``get_buffer``): every rank's buffer mapped into this
  process. One GPU a rank over NVLink, or T processes on one GPU with
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``. Multicast stays off
  (ranks.RANK_ENV); nothing here asks for it.

``green_streams`` splits a GPU's SMs into T disjoint partitions (CUDA green
contexts through the driver API: torch's ``GreenContext.create`` takes the
first n SMs every time, so T of them would overlap) and returns a stream of
each: T ranks launched on them run at once, each on SMs of its own, so every
cross-rank wait is met by a rank that is running.
"""

from __future__ import annotations

import torch

from .errors import K3InputError

GREEN_SM_GRANULE = 8
"""SMs in a green-context partition are a multiple of this on Hopper (the
driver's rule for compute capability 9.x: SM groups of 8)."""


def local_buffers(tp: int, nbytes: int, device) -> list[torch.Tensor]:
    """T zeroed peer buffers on one device."""
    return [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(tp)]


def host_shared_buffers(tp: int, nbytes: int) -> list[torch.Tensor]:
    """T zeroed CPU peer buffers in shared memory (they travel to spawned processes by handle)."""
    return [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(tp)]


def symmetric_buffers(nbytes: int, device, group=None) -> tuple[list[torch.Tensor], object]:
    """This rank's symmetric allocation and every rank's buffer mapped here.

    Collective over ``group`` (default: the world). Returns (buffers, handle):
    buffers[r] is rank r's buffer; keep the handle alive as long as they are used."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    own = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    own.zero_()
    handle = symm_mem.rendezvous(own, group)
    tp = dist.get_world_size(group)
    buffers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(tp)]
    torch.cuda.synchronize(device)
    dist.barrier(group)  # every rank's zeroing is done before anyone pushes
    return buffers, handle


def green_partition_sms(tp: int, sm_count: int) -> int:
    """SMs of each of T equal partitions of a GPU of ``sm_count`` SMs."""
    per_rank = (sm_count // tp) // GREEN_SM_GRANULE * GREEN_SM_GRANULE
    if per_rank < GREEN_SM_GRANULE:
        raise K3InputError(
            f"tp: {tp} green contexts of at least {GREEN_SM_GRANULE} SMs do not fit in {sm_count} SMs"
        )
    return per_rank


def _driver_call(result, what: str):
    """cuda.bindings returns (CUresult, *values): the values, or a clear error."""
    from cuda.bindings import driver

    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"green contexts: {what} failed: {status}")
    return values[0] if len(values) == 1 else values


def green_streams(tp: int, device) -> tuple[list[torch.cuda.Stream], int]:
    """T streams, each on a green context of its own disjoint SM partition.

    Returns (streams, SMs per partition). Needs the ``cuda-bindings`` package
    (CUDA driver API); the contexts live as long as the process."""
    try:
        from cuda.bindings import driver
    except ImportError as missing:
        raise K3InputError("green contexts: the cuda-bindings package is needed (pip install cuda-bindings)") from missing
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    sms = green_partition_sms(tp, torch.cuda.get_device_properties(index).multi_processor_count)
    cu_device = _driver_call(driver.cuDeviceGet(index), "cuDeviceGet")
    whole = _driver_call(
        driver.cuDeviceGetDevResource(cu_device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
        "cuDeviceGetDevResource",
    )
    groups, count, _rest = _driver_call(driver.cuDevSmResourceSplitByCount(tp, whole, 0, sms), "cuDevSmResourceSplitByCount")
    if count != tp:
        raise RuntimeError(f"green contexts: asked for {tp} partitions of {sms} SMs, the driver made {count}")
    streams = []
    for group in groups[:tp]:
        if group.sm.smCount != sms:
            raise RuntimeError(f"green contexts: a partition has {group.sm.smCount} SMs, expected {sms}")
        desc = _driver_call(driver.cuDevResourceGenerateDesc([group], 1), "cuDevResourceGenerateDesc")
        context = _driver_call(
            driver.cuGreenCtxCreate(desc, cu_device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
            "cuGreenCtxCreate",
        )
        stream = _driver_call(
            driver.cuGreenCtxStreamCreate(context, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
            "cuGreenCtxStreamCreate",
        )
        streams.append(torch.cuda.get_stream_from_external(int(stream), device))
    return streams, sms
