"""Fleet-wide threshold pushes, and the controller that steps them toward the audits' suggestion."""
