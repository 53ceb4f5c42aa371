"""Copies between host and device for the expert cache: a dedicated copy stream and events on CUDA, plain
synchronous copies on CPU (where "device" memory is host memory and there is nothing to overlap).

Ordering rules that keep the cache correct on CUDA:
* expert copies run on the copy stream; the compute stream waits for a copy's event before a pass reads it;
* small metadata (routing ids to the host, table updates and pass maps to the device) goes through pinned
  buffers with non-blocking copies on the compute stream, so the host never waits for queued compute;
* a slot is only overwritten when no queued computation can read it: the host has already waited for the layer's
  routing (everything before it on the compute stream is done), slots a pending pass reads are pinned, and a
  chunked layer's copy stream first waits for the compute stream (``after_compute``).
"""

from __future__ import annotations

import contextlib
import time

import torch


class HostTicket:
    """Device tensors on their way to pinned host buffers; ``wait`` returns them as numpy arrays / tensors."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None) -> None:
        self.tensors, self.event = tensors, event

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


class StagingRing:
    """A ring of pinned buffers, each large enough for one expert, to copy from memory that is not pinned
    (a memory-mapped checkpoint): host memcpy into a buffer, then an asynchronous copy to the device."""

    def __init__(self, buffer_bytes: int, count: int) -> None:
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.next = 0

    def stage(self, sources: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """(buffer index, pinned copies of ``sources``); waits if that buffer's last copy is still running."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()
        buf, offset, out = self.buffers[i], 0, []
        for src in sources:
            n = src.numel() * src.element_size()
            view = buf[offset : offset + n].view(src.dtype).view(src.shape)
            view.copy_(src)
            out.append(view)
            offset += (n + 255) // 256 * 256
        return i, out

    def release(self, i: int, event: torch.cuda.Event) -> None:
        self.events[i] = event


class Copier:
    """Issues expert copies, records and waits for their events, and accounts the compute stream's stalls."""

    def __init__(self, device: torch.device, staging: StagingRing | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = staging
        self.layer_ready: dict[int, torch.cuda.Event] = {}  # layer -> event after its latest prefetch copies
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.stall_s = 0.0  # resolved stall time (CUDA: compute waiting on copies; CPU: time spent copying)

    # ---- device -> host ----
    def to_host(self, tensors: list[torch.Tensor], record: bool = True) -> HostTicket:
        """Starts copying small device tensors to the host (on the compute stream, after what is queued).
        ``record=False`` (inside a graph capture) leaves the ticket's event to the caller, recorded after replay."""
        if not self.cuda:
            return HostTicket([t.detach() for t in tensors], None)
        outs = []
        for t in tensors:
            o = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            o.copy_(t, non_blocking=True)
            outs.append(o)
        event = None
        if record:
            event = torch.cuda.Event()
            event.record()
        return HostTicket(outs, event)

    # ---- host -> device ----
    def copy_expert(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """Copies one expert's parts into its slot rows (queued on the copy stream on CUDA)."""
        if not self.cuda:
            t0 = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s)
            self.stall_s += time.perf_counter() - t0
            return
        staged = None
        if self.staging is not None:
            staged, src = self.staging.stage(src)
        with torch.cuda.stream(self.stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
        if staged is not None:
            self.staging.release(staged, self.record())

    def on_stream(self) -> contextlib.AbstractContextManager:
        """Work queued inside runs on the copy stream (after the copies issued so far); on CPU, in place."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def after_compute(self) -> None:
        """Later copies wait for everything queued on the compute stream so far (slots it reads get reused)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> torch.cuda.Event | None:
        """An event after the copies issued so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def compute_wait(self, event: torch.cuda.Event | None) -> None:
        """The compute stream waits for ``event``; the wait is timed (resolved lazily in ``stall_seconds``)."""
        if event is None:
            return
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        torch.cuda.current_stream(self.device).wait_event(event)
        self._stalls.append((ready, event))
        if len(self._stalls) >= 4096:
            self.stall_seconds()

    def prefetched(self, layer: int, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.layer_ready[layer] = event

    def wait_layer(self, layer: int) -> None:
        """Before a pass reads ``layer``'s slots: wait for prefetch copies into that layer still in flight."""
        event = self.layer_ready.pop(layer, None)
        self.compute_wait(event)

    def stall_seconds(self) -> float:
        """Total time the compute stream was ready but waited for copies (synchronises the device)."""
        if self._stalls:
            torch.cuda.synchronize(self.device)
            for ready, done in self._stalls:
                self.stall_s += max(0.0, ready.elapsed_time(done)) / 1e3
            self._stalls.clear()
        return self.stall_s
