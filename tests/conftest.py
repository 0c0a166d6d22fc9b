"""Test-suite wide settings: tests/core and friends import their helpers by module name."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "core"))
torch.set_num_threads(1)
