"""Makes the tiny random HF checkpoints that `configs/math.py:tiny` and `configs/code.py:tiny` use.

  python launch/make_tiny_hf.py                      # both, under /tmp/oapl_jax_tiny_hf/
  python launch/make_tiny_hf.py --out=DIR --preset=tiny_qwen2
"""

import argparse

from oapl_jax.models.tiny_hf import make_tiny_hf

DEFAULT_ROOT = "/tmp/oapl_jax_tiny_hf"

if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=None, help="output folder (default: DEFAULT_ROOT/<preset>)")
  parser.add_argument("--preset", default=None, help="tiny_qwen3 or tiny_qwen2 (default: both)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  for preset in [args.preset] if args.preset else ["tiny_qwen3", "tiny_qwen2"]:
    out = args.out or f"{DEFAULT_ROOT}/{preset}"
    print("wrote", make_tiny_hf(out, preset=preset, seed=args.seed))
