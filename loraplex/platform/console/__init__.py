"""The admin web console at /console: server-rendered pages, a signed session cookie, CSRF on every post."""
