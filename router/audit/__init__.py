"""Background audits (settled answers asked of the top tier too), their rows and agreement, and what
--capture keeps of them."""
