"""Correct implementations of SPEC.md section 3 that share no structure with ours."""
