"""What every request body of the HTTP API shares: unknown top-level keys are refused.

A misspelt ``max_token`` must not silently mean "no limit", so bodies forbid extra keys
unless a route documents why it ignores them (SGLang's native routes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
