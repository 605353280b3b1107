"""fastdit: sparse attention for diffusers DiT pipelines."""
