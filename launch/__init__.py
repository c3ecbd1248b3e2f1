"""Launch helpers: local and cluster run scripts, runtime env, the tiny-model builder."""
