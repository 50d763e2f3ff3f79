"""/api/generate-one and /api/generate-batch, with request_id sessions."""
