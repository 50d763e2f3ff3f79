"""The pages for people: a chat playground at GET / and Swagger UI at /docs."""
