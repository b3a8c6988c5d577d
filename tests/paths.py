"""Locations of the shipped models and workloads, shared by tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "models" / "qwen3-tiny-stdlib"
DRAFTER_DIR = REPO / "models" / "dlite-qwen3-tiny-stdlib"
WORKLOADS = REPO / "benchmarks" / "workloads"
