from loongkit.prelude import PATH

print(PATH)
