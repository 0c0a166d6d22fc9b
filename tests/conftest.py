"""Test-suite wide settings. ``tests`` is a package: shared helpers are imported by their full name
(``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import torch

torch.set_num_threads(1)
