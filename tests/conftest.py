"""Test-suite root: puts ``tests/`` on ``sys.path`` so shared helpers (``text_corpus``)
import from any test directory."""
