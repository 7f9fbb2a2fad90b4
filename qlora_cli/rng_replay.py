"""The random state at a forward, restored when backward reruns it, so dropout masks repeat."""

from __future__ import annotations

import contextlib

import torch


class RngReplay:
    """Taken at forward when `enabled`; `replaying()` reruns with that state and leaves the
    generators as they were afterwards."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.cpu = torch.get_rng_state() if enabled else None
        self.cuda = torch.cuda.get_rng_state(device) if enabled and device.type == "cuda" else None

    @contextlib.contextmanager
    def replaying(self):
        if self.cpu is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
