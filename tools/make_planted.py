"""Generate data/pii/planted.jsonl: multilingual chat-like sentences with planted PII, plus decoys.

    python -m tools.make_planted          # rewrites data/pii/planted.jsonl (deterministic: SEED below)

Every planted value is synthetic and generated here with valid check digits (python-stdnum's check-digit
functions, or its validators to pick the check digit); phone numbers are varied from libphonenumber's example
numbers until `is_valid_number` accepts them. Emails use example.* domains; keys and tokens are random.

One JSON object per line:
  planted: {"id", "lang", "text", "decoy": false, "secrets": [{"kind", "type", "region", "format", "value"}]}
    kind: phone | national_id | iban | card | email | api_key | token; `value` appears verbatim in `text`.
  decoy:   {"id", "lang", "text", "decoy": true, "decoy_type", "secrets": [], "keep": [strings that must survive]}
    secret-looking non-secrets: years, dates, prices, order/reference numbers, quantities, and phone or ID words
    next to numbers that are not theirs.

Two classes fail closed since they leaked from a real access log: a number its writer names as an ID or a phone
number is planted even when it fails its check (near-miss IDs, cards and IBANs with one digit changed, format
`labelled_invalid`; phone numbers in ranges libphonenumber deems unassigned, `labelled_unassigned`), and Chinese
resident IDs whose region code python-stdnum's table lacks, so its validator raises (`validator_error`).
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import phonenumbers
from phonenumbers import PhoneNumberFormat, PhoneNumberType
from stdnum import iban, luhn, verhoeff
from stdnum.be import nn as be_nn
from stdnum.br import cpf as br_cpf
from stdnum.ch import ssn as ch_ssn
from stdnum.cn import ric as cn_ric
from stdnum.de import idnr as de_idnr
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fi import hetu as fi_hetu
from stdnum.fr import nir as fr_nir
from stdnum.gb import nhs as gb_nhs
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.in_ import pan as in_pan
from stdnum.it import codicefiscale as it_cf
from stdnum.jp import in_ as jp_in
from stdnum.kr import rrn as kr_rrn
from stdnum.nl import bsn as nl_bsn
from stdnum.pl import pesel as pl_pesel
from stdnum.se import personnummer as se_pnr
from stdnum.us import ssn as us_ssn

SEED = 20261201
OUT = Path(__file__).resolve().parents[1] / "data" / "pii" / "planted.jsonl"

REGION_LANG = {
    "US": "en", "GB": "en", "DE": "de", "FR": "fr", "ES": "es", "IT": "it", "NL": "nl", "SE": "sv", "PL": "pl",
    "BE": "fr", "CH": "de", "FI": "fi", "CN": "zh", "JP": "ja", "KR": "ko", "TW": "zh-TW", "IN": "hi-en", "BR": "pt",
}

# Phone sentences: with a word that says "phone" (most) and without (formatted numbers only).
PHONE_T = {
    "en": ["Can you write a text to my plumber at {v} saying I'll be home after six?",
           "If the delivery is late, call me on {v} before 5pm.", "My new mobile is {v}, please update my contact card."],
    "de": ["Kannst du mir eine SMS an {v} formulieren, dass ich später komme?",
           "Meine Handynummer ist {v}, bitte ruf mich morgen an.", "Bitte rufen Sie unter {v} an, wenn das Paket da ist."],
    "fr": ["Peux-tu rédiger un SMS pour le {v} pour dire que je serai en retard ?",
           "Mon numéro de portable est le {v}, appelle-moi demain.", "Appelez-moi au {v} quand la commande arrive."],
    "es": ["¿Puedes escribir un mensaje para el {v} diciendo que llego tarde?",
           "Mi número de móvil es {v}, llámame mañana.", "Llama al {v} si el paquete no llega."],
    "it": ["Puoi scrivere un messaggio al {v} per dire che arrivo tardi?",
           "Il mio numero di cellulare è {v}, chiamami domani.", "Chiamami al {v} quando arriva il corriere."],
    "nl": ["Kun je een sms opstellen voor {v} dat ik later ben?", "Mijn mobiele nummer is {v}, bel me morgen.",
           "Bel me op {v} als het pakket er is."],
    "sv": ["Kan du skriva ett sms till {v} om att jag blir sen?", "Mitt mobilnummer är {v}, ring mig imorgon.",
           "Ring mig på {v} när paketet kommer."],
    "pl": ["Napisz SMS-a na numer {v}, że się spóźnię.", "Mój numer telefonu to {v}, zadzwoń jutro.",
           "Zadzwoń pod {v}, gdy paczka dotrze."],
    "fi": ["Voitko kirjoittaa tekstiviestin numeroon {v}, että myöhästyn?", "Puhelinnumeroni on {v}, soita huomenna.",
           "Soita numeroon {v} kun paketti tulee."],
    "zh": ["帮我给{v}发一条短信，说我晚点到。", "我的手机号是{v}，明天给我打电话。", "快递到了请打电话{v}联系我。"],
    "zh-TW": ["幫我寫一則簡訊給{v}，說我會晚到。", "我的手機號碼是{v}，明天打給我。", "包裹到了請撥{v}聯絡我。"],
    "ja": ["{v}に遅れるとメッセージを送る文面を考えてください。", "私の携帯番号は{v}です。明日電話してください。",
           "荷物が届いたら{v}まで電話をお願いします。"],
    "ko": ["{v}로 늦는다고 문자 좀 써줘.", "제 휴대폰 번호는 {v}입니다. 내일 전화 주세요.", "택배 도착하면 {v}로 전화 주세요."],
    "hi-en": ["Mera phone number {v} hai, kal call karna please.", "Delivery boy ko bolo {v} pe call kare.",
              "Ek message likho {v} ke liye ki main late aaunga."],
    "pt": ["Pode escrever uma mensagem para o {v} dizendo que vou me atrasar?",
           "Meu celular é {v}, me liga amanhã.", "Liga para {v} quando a encomenda chegar."],
}
PHONE_NO_KEYWORD_T = {
    "en": "Meet me at the station at 6, or {v} if anything changes.",
    "de": "Treffpunkt ist der Bahnhof um 18 Uhr, sonst {v}.",
    "fr": "Rendez-vous à la gare à 18h, sinon {v}.",
    "ja": "駅で18時に待ち合わせ、変更があれば{v}まで。",
    "zh": "晚上六点车站见，有变化就找{v}。",
    "pt": "Encontro na estação às 18h, qualquer coisa {v}.",
}
# Bare digits with no word saying "phone": the case edgeflow.pii leaves unless a phone word is near.
BARE_NO_WORD_T = {
    "US": ("en", "Dinner at 8? If plans change: {v}"), "CN": ("zh", "明天见，有事{v}。"),
    "ES": ("es", "Nos vemos a las 8, cualquier cosa {v}."), "IT": ("it", "Ci vediamo alle 8, per ogni cosa {v}."),
    "PL": ("pl", "Do zobaczenia o 8, w razie czego {v}."), "BR": ("pt", "Até amanhã, qualquer coisa {v}."),
}

ID_T = {
    "ssn": ("US", "en", ["My SSN is {v} and I need to fill in a W-4, which box does it go in?",
                         "Is it safe to give my social security number {v} to a landlord?",
                         "The form asks for SSN: {v} — do I also need an ITIN?"]),
    "uk_nino": ("GB", "en", ["My National Insurance number is {v}, how do I check my contributions?",
                             "HMRC asked for my NI number ({v}) in an email, is that a scam?"]),
    "gb_nhs": ("GB", "en", ["My NHS number is {v}, how do I register with a new GP?",
                            "Can you explain this letter? It quotes NHS no. {v} and a hospital appointment."]),
    "de_idnr": ("DE", "de", ["Meine Steuer-ID ist {v}, wo trage ich die in ELSTER ein?",
                             "Das Finanzamt schreibt, meine Identifikationsnummer {v} sei falsch hinterlegt.",
                             "Für die Lohnabrechnung: Steuerliche IdNr {v}, Steuerklasse 1."]),
    "fr_nir": ("FR", "fr", ["Mon numéro de sécurité sociale est {v}, comment je fais pour ma carte Vitale ?",
                            "La CPAM me demande mon NIR {v}, c'est normal ?", "Voici mon numéro {v} pour le formulaire."]),
    "es_dni": ("ES", "es", ["Mi DNI es {v}, ¿cómo pido cita para renovarlo?",
                            "Para la reserva del hotel me piden el documento {v}, ¿es seguro?"]),
    "es_nie": ("ES", "es", ["Tengo el NIE {v} y quiero abrir una cuenta bancaria, ¿qué necesito?",
                            "Mi número de extranjero es {v}, ¿sirve para empadronarme?"]),
    "it_cf": ("IT", "it", ["Il mio codice fiscale è {v}, come lo inserisco nel 730?",
                           "Mi hanno chiesto il CF {v} per la tessera sanitaria, va bene?"]),
    "nl_bsn": ("NL", "nl", ["Mijn BSN is {v}, hoe vraag ik toeslagen aan?",
                            "De huisarts vraagt om mijn burgerservicenummer {v}, moet ik dat geven?"]),
    "se_personnummer": ("SE", "sv", ["Mitt personnummer är {v}, hur loggar jag in med BankID?",
                                     "Försäkringskassan vill ha personnummer {v} i blanketten."]),
    "pl_pesel": ("PL", "pl", ["Mój PESEL to {v}, jak założyć profil zaufany?",
                              "W formularzu trzeba podać numer PESEL: {v}, gdzie to wpisać?"]),
    "be_nn": ("BE", "fr", ["Mon numéro de registre national est {v}, comment activer itsme ?",
                           "Le formulaire demande le numéro national {v}, c'est obligatoire ?"]),
    "ch_ssn": ("CH", "de", ["Meine AHV-Nummer ist {v}, wie bekomme ich einen Versicherungsausweis?",
                            "Der Arbeitgeber braucht die AHV {v} für die Lohnabrechnung."]),
    "fi_hetu": ("FI", "fi", ["Henkilötunnukseni on {v}, miten kirjaudun Kelaan?",
                             "Lomakkeessa kysytään henkilötunnusta {v}, onko se turvallista?"]),
    "cn_ric": ("CN", "zh", ["我的身份证号是{v}，怎么在网上办理社保？", "酒店登记需要身份证号码{v}，这样安全吗？",
                            "帮我看看这个号码{v}的格式对不对。"]),
    "jp_my_number": ("JP", "ja", ["マイナンバーは{v}です。確定申告でどこに書けばいいですか？",
                                  "会社に個人番号 {v} を提出するように言われました。"]),
    "kr_rrn": ("KR", "ko", ["제 주민등록번호는 {v}인데 온라인으로 등본 떼는 법 알려주세요.",
                            "은행에서 주민번호 {v} 확인했는데 이거 안전한가요?", "이 번호 {v} 형식이 맞나요?"]),
    "tw_id": ("TW", "zh-TW", ["我的身分證字號是{v}，要怎麼線上報稅？", "申請健保卡要填 {v} 嗎？"]),
    "in_aadhaar": ("IN", "hi-en", ["Mera Aadhaar number {v} hai, isko PAN se link kaise karein?",
                                   "Bank wale {v} maang rahe hain, kya dena safe hai?"]),
    "in_pan": ("IN", "hi-en", ["Mera PAN {v} hai, ITR file karne mein help karo.",
                               "Form 16 mein PAN {v} galat print hua hai, kya karun?"]),
    "br_cpf": ("BR", "pt", ["Meu CPF é {v}, como emito a segunda via do boleto?", "A loja pediu o CPF {v} na nota, é seguro?",
                            "Pode conferir se {v} está no formato certo?"]),
}

IBAN_T = {
    "de": "Meine IBAN ist {v}, kannst du mir eine Überweisungsvorlage schreiben?",
    "fr": "Voici mon IBAN {v} pour le virement du loyer.", "es": "Mi IBAN es {v}, ¿cuánto tarda una transferencia?",
    "it": "L'IBAN per il bonifico è {v}, scrivimi la causale.", "nl": "Mijn rekeningnummer is {v}, kun je een betaalverzoek maken?",
    "en": "Please send the refund to {v}, thanks.", "pl": "Mój numer konta to {v}, przelej proszę do piątku.",
    "sv": "Mitt IBAN är {v}, hur lång tid tar överföringen?", "fi": "Tilinumeroni on {v}, maksa vuokra sinne.",
    "pt": "Meu IBAN é {v}, pode fazer a transferência?",
}
IBAN_COUNTRIES = {  # country: (BBAN spec, language); spec items: (count, 'n' digits | 'a' letters | 'c' alnum)
    "DE": ("8n10n", "de"), "FR": ("5n5n11n2n", "fr"), "ES": ("4n4n1n1n10n", "es"), "IT": ("1a5n5n12n", "it"),
    "NL": ("4a10n", "nl"), "GB": ("4a6n8n", "en"), "BE": ("3n7n2n", "fr"), "CH": ("5n12n", "de"), "AT": ("5n11n", "de"),
    "PL": ("8n16n", "pl"), "SE": ("3n16n1n", "sv"), "FI": ("3n11n", "fi"), "PT": ("4n4n11n2n", "pt"), "IE": ("4a6n8n", "en"),
}

CARD_T = ["My card {v} was charged twice, how do I dispute it?", "Kannst du prüfen, ob die Karte {v} noch gültig ist?",
          "这张卡{v}被盗刷了怎么办？", "カード番号{v}の不正利用を報告したいです。", "Mi tarjeta {v} fue rechazada en la tienda.",
          "카드번호 {v}로 결제가 두 번 됐어요.", "Meu cartão {v} foi clonado, o que faço?", "Ma carte {v} a été bloquée."]
EMAIL_T = ["Write a reply to {v} thanking her for the meeting.", "Schick die Rechnung bitte an {v}.",
           "我的邮箱是{v}，请把资料发给我。", "メールアドレスは{v}です。", "Mi correo es {v}, escríbeme.",
           "이메일 {v}로 보내주세요.", "Mon adresse est {v}.", "Meu e-mail é {v}, me manda o contrato."]
SECRET_T = {
    "api_key": ["Why does client = OpenAI(api_key=\"{v}\") return 401?", "Mein Key {v} funktioniert nicht mehr, warum?",
                "このAPIキー{v}は有効ですか？"],
    "github_token": ["git push fails with my token {v}, what's wrong?", "我的GitHub令牌{v}过期了吗？"],
    "aws_key": ["aws configure asks for the key id, I typed {v}, is that right?", "Mi clave de acceso {v} no funciona."],
    "bearer": ["curl -H \"Authorization: Bearer {v}\" https://api.example.com/v1 returns 403"],
    "jwt": ["Decode this token for me: {v}", "Este token {v} expiró?"],
}

# Decoys: secret-looking numbers that are not secrets (and the exact strings that must survive).
DECOY_PLAIN = [
    ("year", "en", "Between 1999 and 2024 the population grew from 8,336,817 to 8,804,190.", ["1999", "2024", "8,336,817", "8,804,190"]),
    ("year", "de", "Von 1989 bis 2019 hat sich der Umsatz verdreifacht.", ["1989", "2019"]),
    ("date", "en", "The meeting moved from 2026-11-29 to 2026-12-03 at 14:30.", ["2026-11-29", "2026-12-03"]),
    ("date", "de", "Der Termin ist am 29.11.2026 um 09:15 Uhr.", ["29.11.2026"]),
    ("date", "ja", "会議は2026/11/29 10:00からです。", ["2026/11/29"]),
    ("date", "fr", "Le contrat court du 01/02/2025 au 31/01/2026.", ["01/02/2025", "31/01/2026"]),
    ("timestamp", "en", "The log says 2026-11-29 01:23:45 ERROR worker crashed.", ["2026-11-29 01:23:45"]),
    ("price", "en", "The laptop costs $1,299.99 and the monitor $349.", ["1,299.99"]),
    ("price", "de", "Das Haus kostet 1.234.567 € inklusive Garage.", ["1.234.567"]),
    ("price", "ja", "このカメラは¥128,000です。", ["128,000"]),
    ("price", "ko", "월세가 ₩1,500,000으로 올랐어요.", ["1,500,000"]),
    ("price", "pt", "O notebook custa R$ 12.499,90 à vista.", ["12.499,90"]),
    ("price", "hi-en", "Flat ka rent ₹1,25,000 per month hai, zyada hai kya?", ["1,25,000"]),
    ("price", "zh", "这套房子总价3500000元，首付1050000元。", ["3500000", "1050000"]),
    ("order_number", "en", "Order #48213907 still hasn't shipped, can you draft a complaint?", ["48213907"]),
    ("order_number", "en", "My order number is 1029384756 and the tracking says delivered.", ["1029384756"]),
    ("order_number", "en", "Invoice 2026-004417 is overdue by 30 days.", ["2026-004417"]),
    ("order_number", "de", "Bestellnummer 7700123456: die Lieferung fehlt.", ["7700123456"]),
    ("order_number", "fr", "Ma commande n° 123456789 n'est jamais arrivée.", ["123456789"]),
    ("order_number", "es", "El pedido 987654321 llegó roto.", ["987654321"]),
    ("order_number", "ja", "注文番号 1234567890 の配送状況を教えて。", ["1234567890"]),
    ("order_number", "zh", "订单号20241129001还没有发货。", ["20241129001"]),
    ("order_number", "ko", "주문번호 202611290042 배송 조회 부탁해요.", ["202611290042"]),
    ("order_number", "en", "Ticket 5512345678 was closed without a reply.", ["5512345678"]),
    ("quantity", "en", "12345679 × 9 = 111111111, why does that work?", ["12345679", "111111111"]),
    ("quantity", "en", "Pi to 15 digits is 3.14159265358979.", ["3.14159265358979"]),
    ("quantity", "en", "The server at 192.168.100.200 answers on port 8080.", ["192.168.100.200"]),
    ("quantity", "de", "Die Strecke ist 1.234,5 km lang, die Fahrt dauert 12 Stunden.", ["1.234,5"]),
    ("quantity", "en", "ISBN 978-3-16-148410-0 is the second edition.", ["978-3-16-148410-0"]),
    ("quantity", "en", "The build number is 20261129.3 on version 4.2.1.", ["20261129.3"]),
    ("quantity", "en", "Windows reports version 10.0.19045.3803 after the update.", ["10.0.19045.3803"]),
    ("quantity", "en", "The Eiffel Tower is at 48.858370, 2.294481 on the map.", ["48.858370", "2.294481"]),
    ("count", "en", "The table has 48213907 rows after the import.", ["48213907"]),
    ("count", "en", "Downloaded 1073741824 bytes in 12 seconds.", ["1073741824"]),
    ("count", "en", "The video passed 123456789 views this week.", ["123456789"]),
    ("count", "de", "Die Datei hat 987654321 Zeilen, wie teile ich sie auf?", ["987654321"]),
    ("count", "en", "Use seed 3141592653 to reproduce the run.", ["3141592653"]),
    ("count", "zh", "这个城市有21893095人，比去年多。", ["21893095"]),
    ("count", "ja", "東京の人口は13960236人です。", ["13960236"]),
    ("count", "es", "El archivo pesa 734003200 bytes.", ["734003200"]),
]


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def _complete(rng: random.Random, make, valid, tries: int = 10_000) -> str:
    """Draw from make() until valid() accepts (picks a check digit where stdnum has no calc function)."""
    for _ in range(tries):
        v = make()
        if valid(v):
            return v
    raise RuntimeError(f"no valid number after {tries} draws from {make}")


def _date(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(1950, 2004), rng.randint(1, 12), rng.randint(1, 28)


# ---- national IDs: (value as written, compact digits) ------------------------------------------------


def gen_id(kind: str, rng: random.Random, variant: int) -> str:
    if kind == "ssn":
        v = _complete(rng, lambda: f"{rng.randint(1, 665):03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}",
                      us_ssn.is_valid)
        return v if variant % 2 == 0 else v.replace("-", "")
    if kind == "uk_nino":
        first, second = "ABCEGHJKLMNPRSTWXYZ", "ABCEGHJKLMNPRSTWXYZ"
        p = _complete(rng, lambda: rng.choice(first) + rng.choice(second),
                      lambda s: s not in {"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"})
        d = _digits(rng, 6)
        return f"{p} {d[:2]} {d[2:4]} {d[4:]} {rng.choice('ABCD')}" if variant % 2 == 0 else f"{p}{d}{rng.choice('ABCD')}"
    if kind == "gb_nhs":
        v = _complete(rng, lambda: str(rng.randint(4, 9)) + _digits(rng, 9), gb_nhs.is_valid)
        return f"{v[:3]} {v[3:6]} {v[6:]}" if variant % 2 == 0 else v
    if kind == "de_idnr":
        v = _complete(rng, lambda: str(rng.randint(1, 9)) + _digits(rng, 10), de_idnr.is_valid)
        return de_idnr.format(v) if variant % 2 == 0 else v
    if kind == "fr_nir":
        y, m, _ = _date(rng)
        dept = f"{rng.randint(1, 95):02d}"
        body = f"{rng.randint(1, 2)}{y % 100:02d}{m:02d}{dept}{rng.randint(1, 999):03d}{rng.randint(1, 999):03d}"
        v = body + fr_nir.calc_check_digits(body)
        return fr_nir.format(v) if variant % 2 == 0 else v
    if kind == "es_dni":
        d = _digits(rng, 8)
        return d + es_dni.calc_check_digit(d) if variant % 2 == 0 else f"{d}-{es_dni.calc_check_digit(d)}"
    if kind == "es_nie":
        v = _complete(rng, lambda: rng.choice("XYZ") + _digits(rng, 7) + rng.choice(string.ascii_uppercase), es_nie.is_valid)
        return v
    if kind == "it_cf":
        y, m, d = _date(rng)
        day = d + (40 if variant % 2 else 0)
        body = ("".join(rng.choice("BCDFGLMNPRSTVZ") for _ in range(6)) + f"{y % 100:02d}" + "ABCDEHLMPRST"[m - 1]
                + f"{day:02d}" + rng.choice("ABCDEFGHLM") + f"{rng.randint(100, 999)}")
        return body + it_cf.calc_check_digit(body)
    if kind == "nl_bsn":
        v = _complete(rng, lambda: str(rng.randint(1, 6)) + _digits(rng, 8), nl_bsn.is_valid)
        return v if variant % 2 == 0 else f"{v[:4]}.{v[4:6]}.{v[6:]}"
    if kind == "se_personnummer":
        y, m, d = _date(rng)
        v = _complete(rng, lambda: f"{y % 100:02d}{m:02d}{d:02d}-{_digits(rng, 4)}", se_pnr.is_valid)
        return v if variant % 2 == 0 else f"{y // 100}{v}"
    if kind == "pl_pesel":
        y, m, d = _date(rng)
        body = f"{y % 100:02d}{m + (20 if y >= 2000 else 0):02d}{d:02d}{_digits(rng, 4)}"
        return body + pl_pesel.calc_check_digit(body)
    if kind == "be_nn":
        y, m, d = _date(rng)
        v = _complete(rng, lambda: f"{y % 100:02d}{m:02d}{d:02d}{_digits(rng, 5)}", be_nn.is_valid)
        return f"{v[:2]}.{v[2:4]}.{v[4:6]}-{v[6:9]}.{v[9:]}" if variant % 2 == 0 else v
    if kind == "ch_ssn":
        v = _complete(rng, lambda: "756" + _digits(rng, 10), ch_ssn.is_valid)
        return ch_ssn.format(v) if variant % 2 == 0 else v
    if kind == "fi_hetu":
        y, m, d = _date(rng)
        sign = "-" if y < 2000 else "A"
        return _complete(rng, lambda: f"{d:02d}{m:02d}{y % 100:02d}{sign}{rng.randint(2, 899):03d}"
                         + rng.choice("0123456789ABCDEFHJKLMNPRSTUVWXY"), fi_hetu.is_valid)
    if kind == "cn_ric":
        y, m, d = _date(rng)

        def make() -> str:  # area codes must exist in stdnum's table for the birth year
            body = f"{rng.choice(['110101', '110105', '310104', '440305', '510107', '330106'])}{y}{m:02d}{d:02d}{_digits(rng, 3)}"
            return body + cn_ric.calc_check_digit(body + "0")  # stdnum: "passed with the check digit included"

        return _complete(rng, make, cn_ric.is_valid)
    if kind == "jp_my_number":
        body = str(rng.randint(1, 9)) + _digits(rng, 10)
        v = body + jp_in.calc_check_digit(body)
        return f"{v[:4]} {v[4:8]} {v[8:]}" if variant % 2 == 0 else v
    if kind == "kr_rrn":
        y, m, d = _date(rng)
        body = f"{y % 100:02d}{m:02d}{d:02d}{rng.choice('12')}{rng.randint(0, 96):02d}{_digits(rng, 3)}"  # sex, place, serial
        v = body + kr_rrn.calc_check_digit(body)
        return f"{v[:6]}-{v[6:]}" if variant % 3 != 2 else v
    if kind == "tw_id":
        return _complete(rng, lambda: rng.choice("ABCDEFGHJKLMNPQRSTUVXYWZ") + rng.choice("12") + _digits(rng, 8), _tw_ok)
    if kind == "in_aadhaar":
        body = str(rng.randint(2, 9)) + _digits(rng, 10)
        v = body + verhoeff.calc_check_digit(body)
        return f"{v[:4]} {v[4:8]} {v[8:]}" if variant % 2 == 0 else v
    if kind == "in_pan":
        return (_letters(rng, 3) + "P" + _letters(rng, 1) + _digits(rng, 4) + _letters(rng, 1))
    if kind == "br_cpf":
        v = _complete(rng, lambda: _digits(rng, 11), lambda s: br_cpf.is_valid(s) and len(set(s)) > 1)
        return br_cpf.format(v) if variant % 2 == 0 else v
    raise KeyError(kind)


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(n))


def _tw_ok(v: str) -> bool:
    """Independent of edgeflow.pii: the published letter table (A=10 … Z=33, I=34, O=35) and weights."""
    table = dict(zip("ABCDEFGHJKLMNPQRSTUVXYWZIO", range(10, 36)))
    n = table[v[0]]
    total = n // 10 + (n % 10) * 9 + sum(int(c) * w for c, w in zip(v[1:9], range(8, 0, -1))) + int(v[9])
    return total % 10 == 0


# ---- phones, IBANs, cards, secrets -------------------------------------------------------------------


def gen_phone(region: str, rng: random.Random, mobile: bool) -> phonenumbers.PhoneNumber:
    ex = phonenumbers.example_number_for_type(region, PhoneNumberType.MOBILE if mobile else PhoneNumberType.FIXED_LINE)
    nsn = phonenumbers.national_significant_number(ex)
    for _ in range(1000):
        cand = nsn[: len(nsn) - 4] + _digits(rng, 4)
        num = phonenumbers.parse("+" + str(ex.country_code) + cand, None)
        if phonenumbers.is_valid_number(num) and phonenumbers.region_code_for_number(num) == region:
            return num
    raise RuntimeError(f"no valid {region} number near the example {nsn}")


def phone_formats(num: phonenumbers.PhoneNumber) -> dict[str, str]:
    national = phonenumbers.format_number(num, PhoneNumberFormat.NATIONAL)
    return {
        "international": phonenumbers.format_number(num, PhoneNumberFormat.INTERNATIONAL),
        "e164": phonenumbers.format_number(num, PhoneNumberFormat.E164),
        "national": national,
        "national_compact": "".join(c for c in national if c.isdigit()),
    }


def regrouped(num: phonenumbers.PhoneNumber, rng: random.Random) -> str:
    """The national digits grouped the way people type them, not as libphonenumber formats them."""
    digits = "".join(c for c in phonenumbers.format_number(num, PhoneNumberFormat.NATIONAL) if c.isdigit())
    sep = rng.choice([" ", "-", "."])
    size = rng.choice([3, 4])
    groups = [digits[:size]] + [digits[i:i + 4] for i in range(size, len(digits), 4)]
    if len(groups[-1]) < 2:  # no dangling single digit
        groups[-2:] = [groups[-2] + groups[-1]]
    return sep.join(groups)


def gen_iban(country: str, rng: random.Random) -> str:
    spec, _ = IBAN_COUNTRIES[country]

    def make() -> str:
        bban, i = "", 0
        while i < len(spec):
            j = i
            while spec[j].isdigit():
                j += 1
            n, kind = int(spec[i:j]), spec[j]
            bban += _digits(rng, n) if kind in "nc" else _letters(rng, n)
            i = j + 1
        return country + iban.calc_check_digits(country + "00" + bban) + bban

    return _complete(rng, make, iban.is_valid)


CARD_PREFIXES = [("4", 16), ("51", 16), ("55", 16), ("2221", 16), ("34", 15), ("37", 15), ("6011", 16), ("35", 16),
                 ("62", 16), ("62", 19), ("4", 13)]


def gen_card(rng: random.Random, i: int) -> str:
    prefix, n = CARD_PREFIXES[i % len(CARD_PREFIXES)]
    body = prefix + _digits(rng, n - len(prefix) - 1)
    v = body + luhn.calc_check_digit(body)
    style = i % 3
    if n == 15:
        return f"{v[:4]} {v[4:10]} {v[10:]}" if style != 2 else v
    if style == 0:
        return " ".join(v[k:k + 4] for k in range(0, n, 4))
    return "-".join(v[k:k + 4] for k in range(0, n, 4)) if style == 1 else v


def gen_secret(kind: str, rng: random.Random) -> str:
    alnum = string.ascii_letters + string.digits
    rand = lambda n, chars=alnum: "".join(rng.choice(chars) for _ in range(n))  # noqa: E731
    if kind == "api_key":
        return rng.choice(["sk-", "sk-proj-", "sk-live-", "rk-test-", "pk-live-"]) + rand(rng.randint(24, 48))
    if kind == "github_token":
        return rng.choice(["ghp_", "gho_", "ghs_"]) + rand(36)
    if kind == "aws_key":
        return "AKIA" + rand(16, string.ascii_uppercase + string.digits)
    if kind == "bearer":
        return rand(40, alnum + "._-")
    if kind == "jwt":
        b64 = alnum + "-_"
        return "eyJ" + rand(30, b64) + ".eyJ" + rand(60, b64) + "." + rand(43, b64)
    raise KeyError(kind)


NAMES = ["jane.doe", "li.wei", "tanaka.yui", "kim.minjun", "maria.garcia", "j.muller", "priya.sharma", "joao.silva", "a.rossi"]
DOMAINS = ["example.com", "example.org", "example.net", "mail.example.de", "example.co.jp", "example.cn", "example.com.br"]


# ---- assembling ----------------------------------------------------------------------------------------


def build(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []

    def add(lang: str, text: str, secrets: list[dict]) -> None:
        for s in secrets:
            assert s["value"] in text, (s, text)
        out.append({"id": f"p{len(out) + 1:03d}", "lang": lang, "text": text, "decoy": False, "secrets": secrets})

    # phones: every region, four ways of writing a number
    for region, lang in REGION_LANG.items():
        for k, fmt in enumerate(("international", "national", "national_compact", "e164")):
            num = gen_phone(region, rng, mobile=k % 2 == 0)
            v = phone_formats(num)[fmt]
            add(lang, PHONE_T[lang][k % len(PHONE_T[lang])].format(v=v),
                [{"kind": "phone", "type": "phone", "region": region, "format": fmt, "value": v}])
    for region, lang in REGION_LANG.items():  # grouped as typed, not as libphonenumber formats
        v = regrouped(gen_phone(region, rng, mobile=True), rng)
        add(lang, PHONE_T[lang][1].format(v=v),
            [{"kind": "phone", "type": "phone", "region": region, "format": "regrouped", "value": v}])
    for region, (lang, t) in BARE_NO_WORD_T.items():
        v = phone_formats(gen_phone(region, rng, mobile=True))["national_compact"]
        add(lang, t.format(v=v), [{"kind": "phone", "type": "phone", "region": region, "format": "bare_no_word", "value": v}])
    for lang, t in PHONE_NO_KEYWORD_T.items():  # no word saying "phone"
        region = {"en": "GB", "de": "DE", "fr": "FR", "ja": "JP", "zh": "CN", "pt": "BR"}[lang]
        v = phone_formats(gen_phone(region, rng, mobile=True))["national"]
        add(lang, t.format(v=v), [{"kind": "phone", "type": "phone", "region": region, "format": "national", "value": v}])

    # national IDs
    for kind, (region, lang, templates) in ID_T.items():
        for i, t in enumerate(templates):
            v = gen_id(kind, rng, i)
            add(lang, t.format(v=v), [{"kind": "national_id", "type": kind, "region": region,
                                       "format": "compact" if v.isalnum() else "formatted", "value": v}])

    # IBANs (formatted in groups of four, and compact)
    for i, (country, (_, lang)) in enumerate(IBAN_COUNTRIES.items()):
        v = gen_iban(country, rng)
        v = iban.format(v) if i % 2 == 0 else v
        add(lang, IBAN_T[lang].format(v=v), [{"kind": "iban", "type": "iban", "region": country,
                                              "format": "compact" if " " not in v else "formatted", "value": v}])

    # cards
    for i in range(len(CARD_PREFIXES)):
        v = gen_card(rng, i)
        add("mixed", CARD_T[i % len(CARD_T)].format(v=v), [{"kind": "card", "type": "card", "region": None,
                                                             "format": "compact" if v.isdigit() else "formatted", "value": v}])

    # emails
    for i, t in enumerate(EMAIL_T):
        v = f"{NAMES[i % len(NAMES)]}{rng.randint(1, 99)}@{DOMAINS[i % len(DOMAINS)]}"
        add("mixed", t.format(v=v), [{"kind": "email", "type": "email", "region": None, "format": "plain", "value": v}])

    # keys and tokens
    for kind, templates in SECRET_T.items():
        for t in templates:
            v = gen_secret(kind, rng)
            label = "token" if kind in ("bearer", "jwt") else "api_key"
            add("mixed", t.format(v=v), [{"kind": label, "type": kind, "region": None, "format": "plain", "value": v}])

    # several secrets in one message, in one language
    combos = [
        ("de", "DE", "Hallo, ich bin unter {p} erreichbar, Mail {e}, IBAN {i} für die Kaution.", "DE"),
        ("en", "US", "Update my profile: phone {p}, email {e}, and the refund IBAN {i}.", "GB"),
        ("fr", "FR", "Mes coordonnées : {p}, {e}, IBAN {i}.", "FR"),
        ("es", "ES", "Para el contrato: teléfono {p}, correo {e}, cuenta {i}.", "ES"),
        ("zh", "CN", "联系方式：手机{p}，邮箱{e}，身份证{n}。", None),
        ("ja", "JP", "連絡先は電話{p}、メール{e}、マイナンバー{n}です。", None),
        ("ko", "KR", "연락처는 {p}, 이메일 {e}, 주민등록번호 {n}입니다.", None),
        ("pt", "BR", "Meus dados: celular {p}, e-mail {e}, CPF {n}.", None),
        ("hi-en", "IN", "Mera number {p} hai, email {e}, Aadhaar {n}.", None),
        ("it", "IT", "I miei dati: cellulare {p}, email {e}, codice fiscale {n}.", None),
    ]
    id_of = {"CN": "cn_ric", "JP": "jp_my_number", "KR": "kr_rrn", "BR": "br_cpf", "IN": "in_aadhaar", "IT": "it_cf"}
    for lang, region, t, iban_country in combos:
        p = phone_formats(gen_phone(region, rng, mobile=True))["national"]
        e = f"{rng.choice(NAMES)}@{rng.choice(DOMAINS)}"
        secrets = [{"kind": "phone", "type": "phone", "region": region, "format": "national", "value": p},
                   {"kind": "email", "type": "email", "region": None, "format": "plain", "value": e}]
        fields = {"p": p, "e": e}
        if iban_country:
            fields["i"] = iban.format(gen_iban(iban_country, rng))
            secrets.append({"kind": "iban", "type": "iban", "region": iban_country, "format": "formatted", "value": fields["i"]})
        else:
            fields["n"] = gen_id(id_of[region], rng, 0)
            secrets.append({"kind": "national_id", "type": id_of[region], "region": region, "format": "formatted",
                            "value": fields["n"]})
        add(lang, t.format(**fields), secrets)

    # full-width digits, as Japanese and Chinese input methods type them
    for region, lang, t in (("JP", "ja", "携帯は{v}です。"), ("CN", "zh", "我的电话是{v}。")):
        v = phone_formats(gen_phone(region, rng, mobile=True))["national"]
        wide = v.translate({ord(c): chr(ord(c) + 0xFEE0) for c in "0123456789-"})
        add(lang, t.format(v=wide), [{"kind": "phone", "type": "phone", "region": region, "format": "fullwidth", "value": wide}])

    out.extend(build_decoys(rng, start=len(out)))
    # Fail closed. Checksum-valid Chinese resident IDs whose region code python-stdnum's table lacks (its
    # validator raises KeyError), and numbers labelled as phone numbers in ranges libphonenumber deems unassigned.
    for t in ("我的身份证号是{v}", "身份证：{v}，请帮我填表。", "My Chinese ID is {v}, can you check the form?"):
        v = gen_ric_missing_region(rng)
        add("zh" if "身份" in t else "en", t.format(v=v), [{"kind": "national_id", "type": "cn_ric", "region": "CN",
                                                         "format": "validator_error", "value": v}])
    for region, lang, t in UNASSIGNED_PHONE_T:
        v = gen_unassigned_phone(region, rng)
        add(lang, t.format(v=v), [{"kind": "phone", "type": "phone", "region": region, "format": "labelled_unassigned",
                                   "value": v}])
    return out


UNASSIGNED_PHONE_T = [  # (region, language, template): a word naming a phone number right before it
    ("CN", "zh", "我的手机号是{v}，有事打给我。"),
    ("CN", "zh", "我的电话号码：{v}"),
    ("US", "en", "My phone number is {v}, text me when you land."),
    ("DE", "de", "Meine Handynummer ist {v}, ruf einfach an."),
    ("JP", "ja", "私の電話番号は{v}です。"),
    ("KR", "ko", "제 전화번호는 {v}입니다."),
    ("FR", "fr", "Mon numéro de téléphone est le {v}."),
    ("BR", "pt", "Meu celular é {v}, me chama no WhatsApp."),
]


def gen_unassigned_phone(region: str, rng: random.Random) -> str:
    """A national-format digit string of the region's usual length that libphonenumber says is not a valid number."""
    example = phonenumbers.format_number(phonenumbers.example_number_for_type(region, PhoneNumberType.MOBILE),
                                         PhoneNumberFormat.NATIONAL)
    digits = [c for c in example if c.isdigit()]
    for _ in range(10_000):
        lead = "0" if digits[0] == "0" else ""
        v = lead + _digits(rng, len(digits) - len(lead))
        if not phonenumbers.is_valid_number(phonenumbers.parse(v, region)):
            return v
    raise RuntimeError(f"no unassigned {region} number after 10,000 draws")


def gen_ric_missing_region(rng: random.Random) -> str:
    """A checksum-valid 18-character resident ID whose region code makes python-stdnum's validator raise."""
    for _ in range(100_000):
        code = f"{rng.randint(11, 65):02d}{rng.randint(0, 99):02d}{rng.randint(0, 99):02d}"
        y, m, d = _date(rng)
        body = f"{code}{y:04d}{m:02d}{d:02d}{_digits(rng, 3)}"
        v = body + cn_ric.calc_check_digit(body)
        try:
            cn_ric.is_valid(v)
        except KeyError:
            return v
    raise RuntimeError("no resident ID with a region code missing from python-stdnum's table")


NEAR_MISS = [  # (kind, template language, template, is_valid) — a valid value with one digit changed
    ("ssn", "en", "Example from the docs: SSN {v} (not mine).", None),
    ("de_idnr", "de", "Ist die Steuer-ID {v} aus dem Musterbrief echt?", de_idnr.is_valid),
    ("fr_nir", "fr", "Le numéro {v} du formulaire exemple est-il valide ?", fr_nir.is_valid),
    ("es_dni", "es", "¿El DNI {v} del ejemplo es correcto?", es_dni.is_valid),
    ("it_cf", "it", "Il codice {v} dell'esempio è valido?", it_cf.is_valid),
    ("nl_bsn", "nl", "Is BSN {v} uit het voorbeeld geldig?", nl_bsn.is_valid),
    ("pl_pesel", "pl", "Czy PESEL {v} z przykładu jest poprawny?", pl_pesel.is_valid),
    ("cn_ric", "zh", "示例里的身份证号{v}是合法的吗？", cn_ric.is_valid),
    ("jp_my_number", "ja", "例のマイナンバー{v}は正しいですか？", jp_in.is_valid),
    ("kr_rrn", "ko", "예시 주민등록번호 {v} 맞나요?", kr_rrn.is_valid),
    ("tw_id", "zh-TW", "範例身分證字號{v}是真的嗎？", _tw_ok),
    ("in_aadhaar", "hi-en", "Kya Aadhaar {v} sample valid hai?", in_aadhaar.is_valid),
    ("br_cpf", "pt", "O CPF {v} do exemplo é válido?", br_cpf.is_valid),
    ("be_nn", "fr", "Le numéro national {v} de l'exemple est-il bon ?", be_nn.is_valid),
    ("ch_ssn", "de", "Ist die AHV-Nummer {v} im Beispiel gültig?", ch_ssn.is_valid),
    ("gb_nhs", "en", "Is NHS number {v} from the leaflet a real one?", gb_nhs.is_valid),
    ("se_personnummer", "sv", "Är personnummer {v} i exemplet giltigt?", se_pnr.is_valid),
]


def _change_one_digit(rng: random.Random, v: str, still_valid) -> str:
    positions = [i for i, c in enumerate(v) if c.isdigit()]
    for _ in range(1000):
        i = rng.choice(positions)
        w = v[:i] + rng.choice([d for d in string.digits if d != v[i]]) + v[i + 1:]
        if not still_valid(w):
            return w
    raise RuntimeError(f"every one-digit change of {v} stays valid")


def build_decoys(rng: random.Random, start: int) -> list[dict]:
    out: list[dict] = []

    def add(decoy_type: str, lang: str, text: str, keep: list[str]) -> None:
        for k in keep:
            assert k in text, (k, text)
        out.append({"id": f"d{len(out) + 1:03d}", "lang": lang, "text": text, "decoy": True, "decoy_type": decoy_type,
                    "secrets": [], "keep": keep})

    def labelled_invalid(kind: str, type_: str, region: str | None, lang: str, text: str, v: str) -> None:
        # fails its check, but its writer names it: replaced (fail closed), so planted, not a decoy
        out.append({"id": f"n{len(out) + 1:03d}", "lang": lang, "text": text, "decoy": False, "secrets": [
            {"kind": kind, "type": type_, "region": region, "format": "labelled_invalid", "value": v}]})

    for decoy_type, lang, text, keep in DECOY_PLAIN:
        add(decoy_type, lang, text, keep)
    for kind, lang, t, valid in NEAR_MISS:
        if kind == "ssn":  # no check digit: "near miss" = an area number never issued (9xx)
            v = f"9{_digits(rng, 2)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"
        else:
            v = _change_one_digit(rng, gen_id(kind, rng, 0), valid)
        if kind in UNNAMED_NEAR_MISS:  # no word names it: a near miss without a label keeps its digits
            add("near_miss_" + kind, lang, t.format(v=v), [v])
        else:
            labelled_invalid("national_id", kind, NEAR_MISS_REGION[kind], lang, t.format(v=v), v)
    for i in range(5):
        v = _change_one_digit(rng, gen_card(rng, i), luhn.is_valid)
        labelled_invalid("card", "card", None, "en", f"The card number {v} in the tutorial is fake, right?", v)
    for country in ("DE", "FR", "NL", "GB"):
        v = _change_one_digit(rng, iban.format(gen_iban(country, rng)), iban.is_valid)
        labelled_invalid("iban", "iban", country, "en", f"Is {v} from the sample invoice a valid IBAN?", v)
    for decoy_type, lang, text, keep in DECOY_LABEL_WORDS:
        add(decoy_type, lang, text, keep)
    return out


UNNAMED_NEAR_MISS = {"fr_nir", "it_cf"}  # their templates say "le numéro", "il codice": no ID named
NEAR_MISS_REGION = {"ssn": "US", "de_idnr": "DE", "fr_nir": "FR", "es_dni": "ES", "it_cf": "IT", "nl_bsn": "NL",
                    "pl_pesel": "PL", "cn_ric": "CN", "jp_my_number": "JP", "kr_rrn": "KR", "tw_id": "TW",
                    "in_aadhaar": "IN", "br_cpf": "BR", "be_nn": "BE", "ch_ssn": "CH", "gb_nhs": "GB",
                    "se_personnummer": "SE"}
DECOY_LABEL_WORDS = [  # a phone or ID word next to numbers that are not a phone number or an ID
    ("label_word", "en", "My phone has 256 GB of storage and a 5000 mAh battery.", ["256", "5000"]),
    ("label_word", "zh", "我的手机用了3年，电池容量是4500毫安。", ["4500"]),
    ("label_word", "en", "The passport photo must be 35 x 45 mm and the fee is 130 dollars.", ["35", "45", "130"]),
    ("label_word", "de", "Mein Handyvertrag kostet 19,99 Euro im Monat.", ["19,99"]),
    ("label_word", "en", "Which ID card readers support ISO 14443 and ISO 7816?", ["14443", "7816"]),
    ("label_word", "ja", "携帯の料金は月3980円です。", ["3980"]),
    ("label_word", "en", "Phone sales reached 1,200,000,000 units in 2023.", ["1,200,000,000", "2023"]),
    ("label_word", "ko", "휴대폰 판매량이 2024년에 12억 대를 넘었다.", ["2024"]),
    ("label_word", "en", "The order ID: 48213907 was placed from my phone.", ["48213907"]),
    ("label_word", "fr", "Mon téléphone affiche 2026-12-05 comme date de mise à jour.", ["2026-12-05"]),
]


def main() -> None:
    records = build()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    planted = [r for r in records if not r["decoy"]]
    print(f"{OUT}: {len(planted)} planted records ({sum(len(r['secrets']) for r in planted)} secrets), "
          f"{len(records) - len(planted)} decoys")


if __name__ == "__main__":
    main()
