"""Generated example data sets shipped as code (deterministic for a seed, no download).

- `k2_data.examples.tooluse.write_tooluse_dataset(out_dir, n_train, n_heldout, seed)`: a tool-use SFT set.
"""
