"""placeholder"""
def add_command(sub):
    pass
