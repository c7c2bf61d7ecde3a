from loongkit_core.prelude import PATH

print(PATH)
