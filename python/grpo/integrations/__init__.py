"""Integrations of grpo with training frameworks (imported on demand: `grpo.integrations.trl`)."""
