package wire

// One event, in either shape the engines' wire allows: a tag-first array or
// a tagged map. The field table maps both to one wireEvent; the dialect
// decides the few slots where the engines differ (sglangSlot7).

// fieldID names what a map key or an array slot holds.
type fieldID uint8

const (
	fSkip fieldID = iota
	fType
	fHashes
	fParent
	fTokens
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	fExtraKeys
	fGroup
	fKind
	fWindow
	fLocality
	fOwnership
	fSession
	fCacheSalt
	fSGLangSlot7
)

// Array layouts: the slots after the tag, in the order the engines' msgspec
// structs declare their fields. Missing trailing slots read as absent and
// extra ones are skipped, so every schema generation shares one table
// (TokenSpeed's 5-element store is a prefix of it).
var (
	storedSlots = [...]fieldID{fHashes, fParent, fTokens, fBlockSize, fLoraID, fMedium,
		fLoraName, fExtraKeys, fGroup, fKind, fWindow, fLocality, fOwnership, fSession}
	removedSlots = [...]fieldID{fHashes, fMedium, fGroup, fLocality, fOwnership}
	clearedSlots = [...]fieldID{fOwnership}
)

func mapField(key []byte) fieldID {
	switch string(key) {
	case "type":
		return fType
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoraID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoraName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroup
	case "kv_cache_spec_kind":
		return fKind
	case "kv_cache_spec_sliding_window":
		return fWindow
	case "locality":
		return fLocality
	case "ownership":
		return fOwnership
	case "session_id":
		return fSession
	case "cache_salt":
		return fCacheSalt
	}
	return fSkip
}

func tagKind(tag []byte) eventKind {
	switch string(tag) {
	case "BlockStored":
		return kindStored
	case "BlockRemoved":
		return kindRemoved
	case "AllBlocksCleared":
		return kindCleared
	}
	return kindUnknown
}

func (x *decoder) mapEvent(ev *wireEvent) error {
	n, err := x.mapLen()
	if err != nil {
		return err
	}
	kind := kindMalformed
	for i := 0; i < n; i++ {
		key, ok, err := x.mapKey()
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		id := mapField(key)
		if id == fType {
			tag, err := x.tagValue()
			if err != nil {
				return err
			}
			if tag == nil {
				ev.tag, kind = fieldBad, kindMalformed
			} else {
				ev.tag, kind = fieldOK, tagKind(tag)
			}
			continue
		}
		if err := x.field(ev, id); err != nil {
			return err
		}
	}
	ev.kind = kind
	ev.finish()
	return nil
}

// tagValue reads an event tag; nil means it is not text.
func (x *decoder) tagValue() ([]byte, error) {
	c, err := x.peek()
	if err != nil {
		return nil, err
	}
	if !isStr(c) {
		return nil, x.skip()
	}
	b, err := x.rawBytes()
	if b == nil && err == nil {
		b = []byte{}
	}
	return b, err
}

func (x *decoder) arrayEvent(ev *wireEvent) error {
	n, err := x.arrayLen()
	if err != nil {
		return err
	}
	if n == 0 {
		ev.kind, ev.missing = kindMalformed, "type"
		return nil
	}
	tag, err := x.tagValue()
	if err != nil {
		return err
	}
	var slots []fieldID
	if tag == nil {
		ev.tag = fieldBad
	} else {
		ev.tag = fieldOK
		ev.kind = tagKind(tag)
		switch ev.kind {
		case kindStored:
			slots = storedSlots[:]
		case kindRemoved:
			slots = removedSlots[:]
		case kindCleared:
			slots = clearedSlots[:]
		}
	}
	for i := 1; i < n; i++ {
		id := fSkip
		if i-1 < len(slots) {
			id = slots[i-1]
		}
		// SGLang's salted store (#30827) appends {"cache_salt": s} where
		// vLLM has lora_name. smg cannot tell the two apart and loses the
		// salt; the dialect tells us which engine wrote it.
		if id == fLoraName && ev.kind == kindStored && x.dialect == SGLang {
			id = fSGLangSlot7
		}
		if err := x.field(ev, id); err != nil {
			return err
		}
	}
	ev.finish()
	return nil
}

// finish settles a decoded event's kind from its required fields (N5).
func (ev *wireEvent) finish() {
	switch {
	case ev.tag != fieldOK:
		ev.kind, ev.missing = kindMalformed, "type"
	case ev.kind == kindStored:
		switch {
		case ev.hashState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "block_hashes"
		case ev.tokState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "token_ids"
		case ev.sizeState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "block_size"
		}
	case ev.kind == kindRemoved:
		if ev.hashState != fieldOK {
			ev.kind, ev.missing = kindMalformed, "block_hashes"
		}
	}
}

func okState(ok bool) fieldState {
	if ok {
		return fieldOK
	}
	return fieldBad
}

// field decodes the current value into the event field id names. Readable
// but wrongly typed values leave optional fields absent and mark required
// ones bad; only structural failures return an error.
func (x *decoder) field(ev *wireEvent, id fieldID) error {
	var err error
	switch id {
	case fHashes:
		var ok bool
		ev.hashOff, ev.hashN, ok, err = x.hashList()
		ev.hashState = okState(ok)
	case fParent:
		var v int64
		var ok bool
		v, ok, err = x.hash()
		ev.parent = optI64{v: v, ok: ok}
	case fTokens:
		var ok bool
		ev.tokOff, ev.tokN, ev.bigram, ok, err = x.tokenList()
		ev.tokState = okState(ok)
	case fBlockSize:
		var ok bool
		ev.blockSize, ok, err = x.signed()
		ev.sizeState = okState(ok)
	case fLoraID:
		var v int64
		var ok bool
		v, ok, err = x.signed()
		ev.loraID = optI64{v: v, ok: ok}
	case fMedium:
		ev.medium, err = x.text(true)
	case fLoraName:
		ev.loraName, err = x.text(true)
	case fCacheSalt:
		ev.cacheSalt, err = x.text(true)
	case fKind:
		ev.specKind, err = x.text(true)
	case fLocality:
		ev.locality, err = x.text(true)
	case fOwnership:
		ev.ownership, err = x.text(true)
	case fSession:
		ev.sessionID, err = x.text(false)
	case fGroup:
		ev.groupIdx, err = x.unsigned32()
	case fWindow:
		ev.window, err = x.unsigned32()
	case fExtraKeys:
		ev.extraKeys, err = x.extraKeys()
	case fSGLangSlot7:
		err = x.sglangSlot7(ev)
	default:
		err = x.skip()
	}
	return err
}

// sglangSlot7 reads SGLang's 8th store element: the metadata map of a salted
// store, or (never seen from SGLang, but harmless) a vLLM-style lora_name.
func (x *decoder) sglangSlot7(ev *wireEvent) error {
	c, err := x.peek()
	if err != nil {
		return err
	}
	if isStr(c) {
		ev.loraName, err = x.text(true)
		return err
	}
	if !isMap(c) {
		return x.skip()
	}
	n, err := x.mapLen()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		key, ok, err := x.mapKey()
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		switch string(key) {
		case "cache_salt":
			ev.cacheSalt, err = x.text(true)
		case "session_id":
			ev.sessionID, err = x.text(false)
		default:
			err = x.skip()
		}
		if err != nil {
			return err
		}
	}
	return nil
}
