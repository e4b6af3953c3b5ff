"""The build orchestrator: plan → generate → configure → compile → verify → package. Never imports torch or the runtime."""
