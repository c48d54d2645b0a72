# %% [markdown]
# # meshlm from Python
#
# Train a tiny model for a few steps on the demo corpus, generate from it, and convert it to a
# Hugging Face folder and back -- the Python API of docs/api.md. Each `# %%` is a cell (VS Code,
# Jupyter with jupytext, Spyder); or run the whole file from the repository root:
#
#     python examples/notebook.py
#
# It builds data/demo first if it is missing (`meshlm data demo`, a minute or two), and trains
# on the CPU in about a minute.

# %%
import subprocess
import sys
from pathlib import Path

import meshlm

ROOT = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd()
if not (ROOT / "data/demo/blend.json").is_file():
    subprocess.run([sys.executable, "-m", "meshlm", "data", "demo", "--out", str(ROOT / "data/demo")], check=True)

# %% [markdown]
# A config is a YAML file plus `section.key=value` overrides, exactly as on the command line.

# %%
config = meshlm.load_config(ROOT / "configs/tiny.yaml", overrides=[
    "train.steps=30", "train.log_every=10", "train.eval_every=0", "train.save_every=0",
    "train.device=cpu", f"train.run_dir={ROOT / 'runs/notebook'}", f"data.blend={ROOT / 'data/demo/blend.json'}",
])
print(config.model.pattern, config.train.global_batch_size, "sequences of", config.train.seq_len, "tokens per step")

# %% [markdown]
# Training runs in this process; running the cell again resumes from the run's checkpoint (and
# does nothing once `train.steps` is reached).

# %%
result = meshlm.train(config)
print(f"step {result.step}; losses", {step: round(loss, 3) for step, loss in result.losses.items()})

# %% [markdown]
# Load the newest checkpoint as a plain `LanguageModel` and continue a prompt; the tokenizer
# saved with the checkpoint turns text into ids and back.

# %%
model = meshlm.load_model(result.run_dir)
print(repr(meshlm.generate(model, "ROMEO:", max_new_tokens=40, tokenizer=result.run_dir, temperature=0.8, seed=0)))
print(meshlm.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, greedy=True))  # ids in, ids out

# %% [markdown]
# Convert to a Hugging Face folder (transformers loads it as `LlamaForCausalLM`), and back.

# %%
hf_dir = meshlm.convert(result.run_dir, ROOT / "runs/notebook-hf", to="hf", overwrite=True)
back = meshlm.convert(hf_dir, ROOT / "runs/notebook-back", to="meshlm", overwrite=True)
print(sorted(path.name for path in hf_dir.iterdir()))
print(repr(meshlm.generate(back, "ROMEO:", max_new_tokens=20, greedy=True)))  # a path: its own tokenizer
