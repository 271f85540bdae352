"""What a family is: its description (``spec``), the model repository that holds its
variants, how its outputs become a confidence and an accept rule, generation's domain types
and sampling settings, which precision this CPU serves, and its audit settings. Pure domain:
no servers, no runtimes."""
