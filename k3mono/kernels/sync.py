"""Flag words of the mono launch: bounded waits, releases, the health record.

A flag is an int32 counter that is never cleared: a launch of epoch e waits
until the word reaches e * count, and every launch raises it exactly count
times. The comparison is wrap-safe: int32(word - target) >= 0.

* ``wait_counter`` polls through an acquire atomic (a plain or .cv load is
  hoisted out of the loop by the compiler and never sees the flag). The poll
  is bounded by an iteration count (the interpreter needs a bound; on the GPU
  the caller passes a generous spin count). While it spins it also watches
  the rank's alarm word, so once one wait failed every other CTA of the rank
  stops within a few polls instead of spinning out its own bound. On timeout
  the first failing wait writes the health record and every failing wait
  bumps the alarm; the caller gets ok = False and stops its CTA.
* ``raise_counter``: a CTA barrier (every thread's stores of the task are
  done), then one release atomic (Triton runs a scalar atomic on one thread:
  the word grows by exactly one).

Polls and raises are tl.atomic_* (portable to the AMD backend and to the CPU
interpreter); the only inline asm is the optional pause between polls
(``SLEEP_NS`` > 0: NVIDIA builds only; the interpreter always takes 0). SCOPE
is a constexpr: "gpu" between CTAs of one GPU (loopback, every rank on one
device), "sys" where peers write over NVLink.

Health buffer of a rank (int32 words, ``HEALTH_WORDS``):

    0 alarm   failed waits of the launch (0: healthy)
    1 rank    2 layer   3 ticket   4 flag word   5 expected   6 seen   7 epoch
"""

from __future__ import annotations

import triton
import triton.language as tl

HEALTH_WORDS = 16  # 8 record words, the rest spare
H_ALARM, H_RANK, H_LAYER, H_TICKET, H_WORD, H_EXPECTED, H_SEEN, H_EPOCH = range(8)
ALARM_EVERY = tl.constexpr(16)  # polls between two looks at the alarm word


@triton.jit
def reached(seen, target):
    """int32(seen - target) >= 0: right across the int32 wrap."""
    return (seen - target) >= 0


@triton.jit
def poll_once(ptr, SCOPE: tl.constexpr):
    """One acquire read of a flag word."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)


@triton.jit
def pause(ns):
    """Sleep this warp about ``ns`` nanoseconds (inline PTX: compiled builds only).
    A spinning CTA then leaves its SM's issue slots to the CTA beside it, which
    may be running the very task it waits for."""
    return tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def wait_counter(
    ptr,  # int32 flag word
    target,  # int32: epoch * count (wrap-safe)
    limit,  # polls before giving up
    health_ptr,  # int32 [HEALTH_WORDS] of the rank
    rank,
    layer,
    ticket,
    word,  # the flag word's index (for the record)
    epoch,
    SCOPE: tl.constexpr,
    SLEEP_NS: tl.constexpr = 0,  # pause between polls (0: none; compiled builds only)
):
    """Poll ``ptr`` until it reaches ``target`` or ``limit`` polls passed; returns
    ok (int32 1 / 0)."""
    seen = poll_once(ptr, SCOPE)
    n = limit * 0
    while ((seen - target) < 0) & (n < limit):
        if SLEEP_NS > 0:
            pause(SLEEP_NS)
        if n % ALARM_EVERY == ALARM_EVERY - 1:
            # another wait of this rank failed: give up now (its record says why)
            if tl.atomic_add(health_ptr, 0, sem="relaxed", scope=SCOPE) != 0:
                n = limit
        seen = poll_once(ptr, SCOPE)
        n += 1
    ok = reached(seen, target).to(tl.int32)
    if ok == 0:
        first = tl.atomic_add(health_ptr, 1, sem="acq_rel", scope=SCOPE) == 0
        if first:
            tl.store(health_ptr + 1, rank)
            tl.store(health_ptr + 2, layer)
            tl.store(health_ptr + 3, ticket)
            tl.store(health_ptr + 4, word)
            tl.store(health_ptr + 5, target)
            tl.store(health_ptr + 6, seen)
            tl.store(health_ptr + 7, epoch)
    return ok


@triton.jit
def raise_counter(ptr, SCOPE: tl.constexpr):
    """Publish a task: CTA barrier, then one release +1."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope=SCOPE)
