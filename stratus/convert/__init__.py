"""The wire ⇄ domain boundary: each wire concept is converted in one module here, so the
rest of Stratus reads domain types (:class:`stratus.tiers.Tier`, :mod:`stratus.errors`)."""
