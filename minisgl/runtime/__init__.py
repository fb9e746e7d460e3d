"""The processes of a server and what connects them: launch and supervision, the scheduler and
detokenizer processes, the ZeroMQ messages and their codec, the engine client the API process
talks through, `--dp` replicas and the gateway. Nothing here imports FastAPI or the API side."""
