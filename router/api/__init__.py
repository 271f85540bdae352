"""The router's doors: the AgentLink service, the Fleet service and what it answers with (family views,
accuracy), and the OpenAI API."""
