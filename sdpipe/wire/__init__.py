"""What the processes say to each other: the store keys and typed messages (``protocol``) and the event
records (``events``). Used by the driver, the group service and the workers alike.
"""
