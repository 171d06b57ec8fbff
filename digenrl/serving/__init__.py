"""What crosses a process boundary as bytes: the wire format of task values between
Dask workers, the reward server's protocol and client, VLM judges over the OpenAI
API, and the reward server itself (`server`, the one module here above the tasks)."""
