"""What the tests, the benches and the course's own scripts use, and no engine imports.

`common/` itself holds what a chapter's engine and scripts import (config, checkpoint, tokenizer,
models, errors, device, cli; parity and hf_reference for each chapter's parity.py; prepare_models
for the models they load). Everything here only drives, times or checks engines from outside:
- chapters.py: load a chapter's modules under unique names (one process, several chapters);
- testing.py, carried.py: the hooks and helpers every chapter's conftest.py and tests share;
- warm_python.py: scripts run from a warm interpreter, so a test's subprocess starts fast;
- bench.py, serving.py, decoding.py: what the bench scripts measure with;
- diff_chapters.py: `make diff-chapterN`.
"""
