# kvstack: the two commands of the quick start are `make serve` and `make test`.
# Both set up a fresh machine and are fast when nothing changed: `make serve`
# installs the build's system packages, fetches the default model and builds
# only the kvstack executable; `make test` adds the test packages, the Python
# venv with the llama.cpp reference (compiled from source) and every test.
BUILD ?= build
JOBS ?= $(shell nproc)
MODEL ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
CTEST_ARGS ?=
ARGS ?=

.PHONY: all setup deps test-deps venv model build build-kvstack serve test test-fast test-sanitize test-tsan lint bench format tidy clean

all: build

deps:
	@scripts/setup.sh deps

test-deps:
	@scripts/setup.sh test-deps

venv: test-deps
	@scripts/setup.sh venv

model: deps
	@scripts/setup.sh model

setup: deps test-deps venv model

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j $(JOBS)

# Only the executable, not the tests (what `make serve` needs).
build-kvstack: deps $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j $(JOBS) --target kvstack

# The engine's main job on the default model: no venv, no test binaries.
serve: deps model build-kvstack
	@scripts/serve.sh $(BUILD)/src/cli/kvstack $(MODEL) $(ARGS)

# Every test: unit, model (against llama.cpp), e2e, then the sanitizer builds
# (ASan+UBSan unit tests, TSan serving path), then clang-format + clang-tidy.
test: setup build
	cd $(BUILD) && ctest --output-on-failure -j 2 $(CTEST_ARGS)
	@$(MAKE) --no-print-directory test-sanitize
	@$(MAKE) --no-print-directory test-tsan
	@$(MAKE) --no-print-directory lint

test-fast: build
	cd $(BUILD) && ctest --output-on-failure -j 2 -L unit

# ASan+UBSan build of the unit tests (the fast label).
test-sanitize: test-deps
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVSTACK_SANITIZE=address,undefined >/dev/null
	@cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j 2 -L unit

# ThreadSanitizer build of kvstack + scheduler_test: the engine thread,
# concurrent submitters, a live server with streaming, drops and bad requests.
test-tsan: setup
	@scripts/test_tsan.sh build-tsan

# clang-format (check only) and clang-tidy over the tree; warnings are errors.
lint: test-deps $(BUILD)/CMakeCache.txt
	@scripts/lint.sh $(BUILD)

format:
	@git ls-files '*.cpp' '*.h' | xargs clang-format -i

tidy: lint

clean:
	rm -rf $(BUILD) build-asan build-tsan
