"""Gray release: the rollout plans and the judge of each step."""
